"""The local engine: every stage of an RL iteration computed in this process, reading its
inputs from and writing its outputs to the stores (Lance, checkpoints, MLflow).

Each stage takes references and returns references; each validates before it writes and
writes once. The loaded model is cached per process and reloads weights only when the
requested policy version differs from what is in memory.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from PIL import Image

from ..algorithms.base import build_algorithm
from ..algorithms.recipe import eval_recipe, rollout_recipe
from ..algorithms.sampling import SamplerRecipe, replay_step, sample
from ..artifacts.checkpoints import (
    CheckpointRef,
    read_counters,
    save_checkpoint,
    verify_checkpoint,
)
from ..artifacts.media import image_grid
from ..artifacts.retention import prune_checkpoints
from ..artifacts.tracking import PolicyRef
from ..artifacts.trajectories import (
    TableRef,
    TrajectoryStore,
    fixed_list,
    meta_json,
    rewards_column,
    tensor_column,
    tensor_from,
    trajectory_schema,
)
from ..config.schema import ExperimentConfig
from ..datasets.prompts import choose_prompts, load_prompt_set, select_categories
from ..datasets.shapes.evaluate import evaluate as evaluate_shapes
from ..rewards.compose import RewardSet
from ..artifacts.files import write_json_atomic
from .assets import resolve_asset
from .base import EngineBase
from .chaos import fault_point


@dataclass(frozen=True)
class RunSpec:
    """Everything a stage needs to find its run: small and serialisable, passed to every task."""

    config: dict
    run_id: str  # MLflow run id; also the run_id column of the trajectory table
    run_name: str
    workdir: str
    tracking_uri: str
    table_uri: str
    model_name: str

    @property
    def cfg(self) -> ExperimentConfig:
        return ExperimentConfig.model_validate(self.config)


@dataclass
class BatchPlan:
    """Training micro-batches (sample ids) grouped by optimizer step, formed by replay."""

    steps: list[list[list[str]]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"steps": self.steps}


def _seed(run_seed: int, *parts: int) -> int:
    return int(np.random.SeedSequence([run_seed, *parts]).generate_state(1, dtype=np.uint64)[0] >> 1)


def _png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def decode_png(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _encode_unique(fam, prompts: list[str]):
    """Encode the iteration's distinct prompts in one sorted batch. Rollout and update both use
    this, so the embeddings are bit-identical (a different text-encoder batch would not be)."""
    uniq = sorted(set(prompts))
    return fam.encode_prompts(uniq), {t: i for i, t in enumerate(uniq)}


class LocalEngine(EngineBase):
    def __init__(self, spec: RunSpec):
        super().__init__(spec)
        self.store = TrajectoryStore(spec.table_uri)
        self.algorithm = build_algorithm(self.cfg.algorithm)

    def _checkpoint_dir(self, policy: PolicyRef) -> Path | None:
        if policy.version == 0:
            return None
        own = self._own_checkpoint(policy)
        if own is not None:  # this run wrote it: no second copy from the registry
            return own
        local = Path(self.spec.workdir) / "cache" / "policies" / f"{policy.model_name}-v{policy.version}"
        if not (local / "counters.json").is_file():
            local = self.tracker.download(policy, local.parent / (local.name + ".dl"))
            target = local.parent.parent / f"{policy.model_name}-v{policy.version}"
            if not target.exists():
                local.rename(target)
            local = target
        return local

    def _own_checkpoint(self, policy: PolicyRef) -> Path | None:
        """The local checkpoint directory of a version this run published, if it is intact."""
        if policy.model_name != self.spec.model_name or not policy.checkpoint_id:
            return None
        if not (policy.source or "").rpartition("/")[2].startswith("it_"):
            return None
        d = self._checkpoint_path(int(policy.source.rpartition("/it_")[2]))  # logged under checkpoints/it_NNNN
        try:
            if d.is_dir() and read_counters(d)["checkpoint_id"] == policy.checkpoint_id:
                return d
        except (OSError, ValueError, KeyError):
            pass
        return None

    def use_policy(self, policy: PolicyRef) -> Path | None:
        ckpt = self._checkpoint_dir(policy)
        self.policy.load_version(ckpt, policy.checkpoint_id)
        return ckpt

    # --- generate -----------------------------------------------------------------------------
    def generate(self, iteration: int, policy: PolicyRef) -> tuple[TableRef, dict | None]:
        if self.store.count(self.spec.run_id, iteration):  # committed before: the store decides
            return self._latest(), None
        cfg, s = self.cfg, self.cfg.sampling
        items = select_categories(load_prompt_set(resolve_asset(cfg.dataset.path)), cfg.dataset.categories)
        rng = np.random.default_rng(_seed(cfg.run.seed, iteration, 0))
        prompts = choose_prompts(items, s.prompts_per_iteration, rng)
        recipe = rollout_recipe(s, rng)
        self.use_policy(policy)
        fam = self.policy.family
        rows = [(slot, g, p) for slot, p in enumerate(prompts) for g in range(s.group_size)]
        cond_all, pos = _encode_unique(fam, [p.prompt for p in prompts])
        neg = fam.encode_prompts([""]) if s.guidance_scale > 1 else None
        seeds = [_seed(cfg.run.seed, iteration, 1, slot, g) for slot, g, _ in rows]
        trajs = []
        t0 = time.perf_counter()
        self.policy.module.eval()
        for start in range(0, len(rows), s.micro_batch):
            chunk = rows[start:start + s.micro_batch]
            cond = cond_all.select([pos[p.prompt] for _, _, p in chunk])
            gens = [torch.Generator().manual_seed(seeds[start + i]) for i in range(len(chunk))]
            trajs.append(sample(fam, cond, neg.expand(len(chunk)) if neg else None, gens, recipe))
        seconds = time.perf_counter() - t0
        lat = torch.cat([t.latents for t in trajs]).numpy()
        nxt = torch.cat([t.next_latents for t in trajs]).numpy()
        lps = torch.cat([t.log_probs for t in trajs]).numpy()
        fin = torch.cat([t.final for t in trajs]).numpy()
        n, S = len(rows), len(recipe.train_steps)
        T = recipe.steps
        sig, ts = trajs[0].sigmas.numpy(), trajs[0].timesteps.numpy()
        recipe_json = json.dumps({**recipe.to_dict(), "resolution": list(fam.latent_shape()),
                                  "dtype": cfg.model.dtype, "engine": "local", "torch": torch.__version__,
                                  "micro_batch": s.micro_batch, "shift": fam.scheduler.config.get("shift")})
        schema = trajectory_schema(S, fam.latent_shape(), T)
        sem = fam.semantics
        table = pa.Table.from_arrays([
            pa.array([self.spec.run_id] * n), pa.array([iteration] * n, pa.int32()),
            pa.array([f"{iteration:05d}-{slot:03d}-{g:02d}" for slot, g, _ in rows]),
            pa.array([p.prompt_id for _, _, p in rows]), pa.array([p.prompt for _, _, p in rows]),
            pa.array([meta_json(p.meta) for _, _, p in rows]),
            pa.array([slot for slot, _, _ in rows], pa.int32()), pa.array([g for _, g, _ in rows], pa.int32()),
            pa.array(seeds, pa.int64()), pa.array([policy.version] * n, pa.int32()),
            pa.array([fam.name] * n), pa.array([sem.regime.value] * n), pa.array([sem.step.value] * n),
            pa.array([recipe_json] * n),
            fixed_list(np.tile(ts, (n, 1)), T), fixed_list(np.tile(sig, (n, 1)), T + 1),
            fixed_list(np.tile(np.array(recipe.train_steps, np.int32), (n, 1)), S, pa.int32()),
            tensor_column(lat), tensor_column(nxt), fixed_list(lps, S), tensor_column(fin),
            pa.nulls(n, pa.binary()), pa.nulls(n, schema.field("rewards").type), pa.nulls(n, pa.float32()),
            pa.nulls(n, pa.float32()),
        ], schema=schema)
        metrics = self._before_commit("generate", iteration, {"images_per_s": n / seconds, "generate_compute_s": seconds})
        ref = self.store.append(table)
        self.store.tag(f"{self.spec.run_name}-it{iteration}-generate", ref.version)
        return ref, metrics

    # --- decode -------------------------------------------------------------------------------
    def decode(self, iteration: int, ref: TableRef) -> tuple[TableRef, dict | None]:
        if self._complete(iteration, "image"):
            return self._latest(), None
        t = self.store.read(ref, self.spec.run_id, iteration, ["run_id", "iteration", "sample_id", "final_latent"])
        lat = torch.from_numpy(tensor_from(t["final_latent"]).copy())
        t0 = time.perf_counter()
        imgs = np.concatenate([self.policy.family.decode(lat[i:i + 64]) for i in range(0, len(lat), 64)])
        pngs = [_png(im) for im in imgs]
        seconds = time.perf_counter() - t0
        g = self.cfg.sampling.group_size
        rows = min(8, len(imgs) // g)
        grid = image_grid(imgs[: rows * g], cols=g, scale=4)
        self.tracker.log_image(self.spec.run_id, grid, key="samples", step=iteration)
        self.tracker.log_image_file(self.spec.run_id, grid, f"samples/it_{iteration:04d}.png")
        upd = pa.table({"run_id": t["run_id"], "iteration": t["iteration"], "sample_id": t["sample_id"],
                        "image": pa.array(pngs, pa.binary())})
        metrics = self._before_commit("decode", iteration, {"decode_compute_s": seconds})
        out = self.store.merge(upd)
        return out, metrics

    # --- score --------------------------------------------------------------------------------
    def score(self, iteration: int, ref: TableRef) -> tuple[TableRef, dict | None]:
        if self._complete(iteration, "reward"):
            return self._latest(), None
        t = self.store.read(ref, self.spec.run_id, iteration,
                            ["run_id", "iteration", "sample_id", "prompt", "prompt_meta", "image"])
        missing = [sid for sid, im in zip(t["sample_id"].to_pylist(), t["image"].to_pylist()) if im is None]
        if missing:
            raise RuntimeError(f"samples {missing[:3]} have no decoded image; run decode for iteration {iteration} first")
        imgs = np.stack([decode_png(b) for b in t["image"].to_pylist()])
        rs = RewardSet(self.cfg.reward.weights, self.cfg.reward.options)
        t0 = time.perf_counter()
        scores = rs.score(imgs, t["prompt"].to_pylist(), [json.loads(m) for m in t["prompt_meta"].to_pylist()],
                          t["sample_id"].to_pylist())
        seconds = time.perf_counter() - t0
        n = t.num_rows
        upd = pa.table({"run_id": t["run_id"], "iteration": t["iteration"], "sample_id": t["sample_id"],
                        "rewards": rewards_column(scores, n), "reward": pa.array(scores["reward"], pa.float32())})
        metrics = {"score_compute_s": seconds}
        for k, v in scores.items():
            metrics[f"reward/{k}/mean"] = float(np.mean(v))
            metrics[f"reward/{k}/std"] = float(np.std(v))
        self._before_commit("score", iteration, metrics)
        out = self.store.merge(upd)
        return out, metrics

    # --- replay -------------------------------------------------------------------------------
    def replay(self, iteration: int, ref: TableRef) -> tuple[TableRef, BatchPlan, dict | None]:
        if self._complete(iteration, "advantage"):
            t = self.store.read(self._latest(), self.spec.run_id, iteration, ["sample_id", "advantage"])
            return self._latest(), self._plan(t["sample_id"].to_pylist(), t["advantage"].to_numpy()), None
        t = self.store.read(ref, self.spec.run_id, iteration, ["run_id", "iteration", "sample_id", "group_id", "reward"])
        rewards = t["reward"].to_numpy(zero_copy_only=False)
        if np.any(np.isnan(rewards)) or t["reward"].null_count:
            raise RuntimeError(f"iteration {iteration} has unscored samples; run score first")
        adv = self.algorithm.advantages(rewards, t["group_id"].to_numpy())
        upd = pa.table({"run_id": t["run_id"], "iteration": t["iteration"], "sample_id": t["sample_id"],
                        "advantage": pa.array(adv.advantages, pa.float32())})
        plan = self._plan(t["sample_id"].to_pylist(), adv.advantages)
        metrics = {"zero_std_ratio": adv.zero_std_ratio, "advantage/mean": float(adv.advantages.mean()),
                   "advantage/std": float(adv.advantages.std()), "advantage/abs_max": float(np.abs(adv.advantages).max()),
                   "samples_trained": float(sum(len(mb) for step in plan.steps for mb in step))}
        self._before_commit("replay", iteration, metrics)
        out = self.store.merge(upd)
        return out, plan, metrics

    def _plan(self, sample_ids: list[str], advantages: np.ndarray) -> BatchPlan:
        """Micro-batches in rollout order (zero-advantage samples dropped if configured), split
        into contiguous optimizer-step groups. A pure function of the stored advantages."""
        a, s = self.cfg.algorithm, self.cfg.sampling
        kept = [sid for sid, adv in zip(sample_ids, advantages) if adv != 0 or not a.filter_zero_advantage]
        micro = [kept[i:i + s.micro_batch] for i in range(0, len(kept), s.micro_batch)]
        n_opt = min(a.optimizer_steps_per_iteration, len(micro))
        bounds = np.linspace(0, len(micro), n_opt + 1).round().astype(int) if micro else []
        return BatchPlan([micro[bounds[i]:bounds[i + 1]] for i in range(n_opt)] if micro else [])

    # --- update -------------------------------------------------------------------------------
    def update(self, iteration: int, ref: TableRef, plan: BatchPlan,
               policy: PolicyRef) -> tuple[CheckpointRef, dict | None]:
        out_dir = self._checkpoint_path(iteration)
        if out_dir.exists():  # renamed into place = complete; a checksum mismatch raises CorruptCheckpoint
            verify_checkpoint(out_dir)
            return CheckpointRef(str(out_dir), read_counters(out_dir)["checkpoint_id"], iteration), None
        ckpt_dir = self.use_policy(policy)
        try:
            return self._update(iteration, ref, plan, policy, ckpt_dir, out_dir)
        except BaseException:
            self.policy.invalidate()  # weights may be half-stepped: reload from a checkpoint next time
            raise

    def update_into(self, iteration: int, policy: PolicyRef, out_dir: Path) -> CheckpointRef:
        """Recompute iteration's update from its stored trajectories and advantages into out_dir,
        leaving the run's own checkpoint and records alone (replay / audit)."""
        t = self.store.read(self._latest(), self.spec.run_id, iteration, ["sample_id", "advantage"])
        if t.num_rows == 0 or t["advantage"].null_count:
            raise RuntimeError(f"iteration {iteration} of run {self.spec.run_name!r} has no complete replay stage "
                               f"in {self.store.uri}; nothing to recompute")
        plan = self._plan(t["sample_id"].to_pylist(), t["advantage"].to_numpy())
        ckpt_dir = self.use_policy(policy)
        try:
            ck, _ = self._update(iteration, self._latest(), plan, policy, ckpt_dir, out_dir, record=False)
        finally:
            self.policy.invalidate()  # the in-memory weights are the replay's, not the run's
        return ck

    def _update(self, iteration: int, ref: TableRef, plan: BatchPlan, policy: PolicyRef,
                ckpt_dir: Path | None, out_dir: Path, record: bool = True) -> tuple[CheckpointRef, dict]:
        a = self.cfg.algorithm
        pol = self.policy
        opt = pol.ensure_optimizer(ckpt_dir)
        fam = pol.family
        cols = ["sample_id", "prompt", "latents", "next_latents", "log_probs", "advantage", "timesteps", "sigmas",
                "stored_steps", "recipe"]
        t = self.store.read(ref, self.spec.run_id, iteration, cols)
        index = {sid: i for i, sid in enumerate(t["sample_id"].to_pylist())}
        lat_all, nxt_all = tensor_from(t["latents"]), tensor_from(t["next_latents"])
        old_lp_all = np.asarray(t["log_probs"].to_pylist(), np.float32)
        adv_all = t["advantage"].to_numpy(zero_copy_only=False)
        prompts = t["prompt"].to_pylist()
        rec = json.loads(t["recipe"][0].as_py())
        recipe = SamplerRecipe(rec["steps"], rec["noise_level"], rec["sde_type"],
                               rec["guidance_scale"] if a.train_cfg else 1.0,
                               tuple(rec["sde_steps"]) if rec["sde_steps"] is not None else None,
                               tuple(rec["train_steps"]))
        sigmas = torch.tensor(t["sigmas"][0].as_py())
        timesteps = torch.tensor(t["timesteps"][0].as_py())
        stored = t["stored_steps"][0].as_py()
        neg = fam.encode_prompts([""]) if recipe.guidance_scale > 1 else None
        cond_all, pos = _encode_unique(fam, prompts)
        pol.module.train()
        params = list(pol.trainable_parameters().values())
        acc: dict[str, list[float]] = {}
        t0 = time.perf_counter()
        for opt_step, step_batches in enumerate(plan.steps):
            opt.zero_grad(set_to_none=True)
            n_terms = len(step_batches) * len(stored)
            for mb in step_batches:
                idx = [index[sid] for sid in mb]
                cond = cond_all.select([pos[prompts[i]] for i in idx])
                negb = neg.expand(len(idx)) if neg else None
                adv = torch.from_numpy(adv_all[idx])
                for j, k in enumerate(stored):
                    x = torch.from_numpy(lat_all[idx, j].copy())
                    x1 = torch.from_numpy(nxt_all[idx, j].copy())
                    out = replay_step(fam, x, x1, k, sigmas, timesteps, cond, negb, recipe)
                    old = torch.from_numpy(old_lp_all[idx, j])
                    ref_out = None
                    if self.algorithm.needs_reference:
                        with torch.no_grad():
                            ref_out = replay_step(pol.reference(), x, x1, k, sigmas, timesteps, cond, negb, recipe)
                    loss, m = self.algorithm.transition_loss(out, old, adv, ref_out)
                    if opt_step == 0:  # before any update: off-policy drift is numerics only
                        m["onpolicy_ratio_dev"] = torch.max(torch.abs(m["ratio_max"] - 1), torch.abs(m["ratio_min"] - 1))
                    (loss / n_terms).backward()
                    m["loss"] = loss.detach()
                    for key, val in m.items():
                        acc.setdefault(key, []).append(float(val))
            gnorm = torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
            acc.setdefault("grad_norm", []).append(float(gnorm))
            opt.step()
        seconds = time.perf_counter() - t0
        pol.module.eval()
        metrics = {"update_compute_s": seconds, "lr": opt.param_groups[0]["lr"],
                   "optimizer_steps": float(len(plan.steps))}
        for key, vals in acc.items():
            if key == "ratio_min":
                metrics[key] = float(np.min(vals))
            elif key in ("ratio_max", "onpolicy_ratio_dev"):
                metrics[key] = float(np.max(vals))
            else:
                metrics[key] = float(np.mean(vals))
        if record:
            self._before_commit("update", iteration, metrics)
        counters = {"iteration": iteration, "optimizer_steps": len(plan.steps), "policy_version_in": policy.version,
                    "policy_model_in": policy.model_name}
        ck = save_checkpoint(out_dir, pol.state(), opt.state_dict(), counters, self.spec.config)
        pol.mark(ck.checkpoint_id)
        return ck, metrics

    # --- publish ------------------------------------------------------------------------------
    def publish(self, iteration: int, ckpt: CheckpointRef) -> tuple[PolicyRef, dict | None]:
        done = self.tracker.find_version(self.spec.model_name, self.spec.run_id, iteration)
        if done is not None:  # registered before a crash: make sure the alias reached it
            self.tracker.move_alias(done)
            return done, None
        verify_checkpoint(Path(ckpt.uri))  # never publish a partial or corrupted checkpoint
        ref = self.tracker.publish(self.spec.run_id, Path(ckpt.uri), iteration, self.spec.model_name,
                                   ckpt.checkpoint_id, {"run_name": self.spec.run_name},
                                   before_alias=lambda: fault_point("publish", iteration))
        metrics = {"policy_version": ref.version}
        keep = self.cfg.run.keep_checkpoints
        if keep:
            pruned = prune_checkpoints(self.tracker, self.spec.model_name, self.spec.run_id,
                                       self._checkpoint_path(0).parent, keep)
            metrics["checkpoints_pruned"] = float(len(pruned))
        return ref, metrics

    # --- reporting ----------------------------------------------------------------------------
    def reward_report(self, iteration: int) -> list[dict]:
        """Reward statistics of a scored iteration, per component and per prompt category."""
        t = self.store.read(self._latest(), self.spec.run_id, iteration, ["rewards", "reward", "prompt_meta"])
        rows = []
        comps: dict[str, list[float]] = {}
        for items in t["rewards"].to_pylist():
            for item in items or []:
                comps.setdefault(item["name"], []).append(item["value"])
        total = t["reward"].to_numpy(zero_copy_only=False)
        for name, vals in [("reward (total)", total), *sorted(comps.items())]:
            v = np.asarray(vals, np.float64)
            rows.append({"group": "component", "name": name, "n": int(v.size), "mean": round(float(v.mean()), 4),
                         "std": round(float(v.std()), 4), "min": round(float(v.min()), 4),
                         "max": round(float(v.max()), 4)})
        cats = np.array([json.loads(m).get("category") or "—" for m in t["prompt_meta"].to_pylist()])
        for cat in sorted(set(cats)):
            v = total[cats == cat].astype(np.float64)
            rows.append({"group": "category", "name": cat, "n": int(v.size), "mean": round(float(v.mean()), 4),
                         "std": round(float(v.std()), 4), "min": round(float(v.min()), 4),
                         "max": round(float(v.max()), 4)})
        return rows

    # --- evaluate (optional, every run.eval_every iterations) -----------------------------------
    def evaluate(self, after: int, policy: PolicyRef) -> dict | None:
        """Held-out accuracy of `policy` (the weights after `after` iterations) with the shared ODE
        evaluation; tags the version with it and moves the experiment's alias `champion` to it when
        it beats the experiment's best so far. Done before: the record."""
        path = self._record_path("evaluate", after)
        if path.is_file():
            return json.loads(path.read_text())
        self.use_policy(policy)
        res = evaluate_shapes(self.policy.family, "heldout", eval_recipe(self.cfg.sampling),
                              self.cfg.run.eval_per_category)
        metrics = {f"heldout/{k}": v for k, v in res.items() if isinstance(v, float)}
        if policy.version > 0 and self.tracker.record_evaluation(policy, res["accuracy"], res["n"]):
            metrics["heldout/champion_version"] = float(policy.version)
        write_json_atomic(path, metrics)
        return metrics

    # --- stage records: metrics that survive a crash between commit and logging -----------------
    def _record_path(self, stage: str, iteration: int) -> Path:
        return Path(self.spec.workdir) / "records" / self.spec.run_name / self.spec.run_id / f"it_{iteration:04d}" / f"{stage}.json"

    def _before_commit(self, stage: str, iteration: int, metrics: dict) -> dict:
        """Write the stage's metrics (atomically, replacing an uncommitted attempt's), then the
        fault-injection point; the caller commits next. A resume that finds the commit but not
        the MLflow metrics logs them from this record (`recorded_metrics`)."""
        write_json_atomic(self._record_path(stage, iteration), metrics)
        fault_point(stage, iteration)
        return metrics

    def recorded_metrics(self, stage: str, iteration: int) -> dict | None:
        """Metrics of a committed stage, for logging them if the process died before it could."""
        if stage == "publish":
            done = self.tracker.find_version(self.spec.model_name, self.spec.run_id, iteration)
            return {"policy_version": done.version} if done else None
        path = self._record_path(stage, iteration)
        return json.loads(path.read_text()) if path.is_file() else None

    # --- what the stores already hold ---------------------------------------------------------
    def _latest(self) -> TableRef:
        return TableRef(self.store.uri, self.store.latest_version())

    def _complete(self, iteration: int, column: str) -> bool:
        n = self.store.count(self.spec.run_id, iteration)
        return n > 0 and self.store.count(self.spec.run_id, iteration, where=f"{column} IS NOT NULL") == n

    def _checkpoint_path(self, iteration: int) -> Path:
        return Path(self.spec.workdir) / "checkpoints" / self.spec.run_name / self.spec.run_id / f"it_{iteration:04d}"


_ENGINES: dict[str, LocalEngine] = {}


def get_engine(spec: RunSpec) -> LocalEngine:
    """One engine (and one loaded model) per run per process."""
    key = spec.run_id
    if key not in _ENGINES:
        _ENGINES.clear()  # one run's model at a time keeps memory bounded
        _ENGINES[key] = LocalEngine(spec)
    return _ENGINES[key]
