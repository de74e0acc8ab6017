"""The offline Diffusion-DPO engine: select archived rollouts, pair them, train, publish, evaluate.

Each stage reads its inputs from and writes its outputs to the stores, and first checks whether
its output is already there (so a rerun of the flow resumes). Artifacts:
- `<store_root>/<run>/selection.lance`: the selected rows' keys, prompts and rewards;
- `<store_root>/<run>/pairs.lance`: winner/loser keys per pair, with rewards and margin;
- `checkpoints/<run>/<run_id>/dpo_final`: the trained weights (same format as the online loop),
  registered in MLflow as a version of the experiment's `<experiment>-policy` (alias `rollout`).
Latents are never copied: update reads them by key from the pinned source versions.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import torch

from ..algorithms.diffusion_dpo import dpo_loss, noised, sample_sigmas, velocity_error
from ..algorithms.pairing import make_pairs
from ..algorithms.recipe import eval_recipe
from ..artifacts.archive import PinnedTable, component_value, select_rows
from ..artifacts.checkpoints import CheckpointRef, load_weights, read_counters, save_checkpoint, verify_checkpoint
from ..artifacts.files import write_json_atomic
from ..artifacts.trajectories import TrajectoryStore, tensor_from
from ..artifacts.tracking import PolicyRef
from ..datasets.shapes.evaluate import evaluate
from .base import EngineBase
from .local import RunSpec

FINAL = "dpo_final"
log = logging.getLogger("pixrl.dpo")


class OfflineError(RuntimeError):
    pass


def _write_once(uri: str, table: pa.Table) -> int:
    """Create a Lance table in one commit; an existing one is kept, never replaced."""
    if _exists(uri):
        return lance.dataset(uri).version
    return lance.write_dataset(table, uri, mode="create").version


def _exists(uri: str) -> bool:
    return TrajectoryStore(uri).exists()


def _group_keys(sel: pa.Table) -> list[tuple]:
    """Pairs never cross this key: one rollout group of one prompt in one source iteration."""
    return list(zip(sel["source"].to_pylist(), sel["run_id"].to_pylist(), sel["iteration"].to_pylist(),
                    sel["group_id"].to_pylist(), sel["prompt"].to_pylist()))


def check_selection(tables: list[PinnedTable], d) -> None:
    """Fail with the fix before anything is written: no rows selected, or no pair formed."""
    rows = select_rows(tables, d)
    if rows.num_rows == 0:
        raise OfflineError(f"the filters select no scored rollouts from {[t.ref for t in tables]}; "
                           f"loosen dpo.iteration_range / policy_versions / reward_min / categories")
    pairs = make_pairs(_group_keys(rows), pair_scores(rows, d.pair_on), d.pairing, d.margin)
    if pairs.count == 0:
        raise OfflineError(f"no preference pairs: all {pairs.groups} selected groups are tied or below margin "
                           f"{d.margin}; lower dpo.margin or select more rollouts")


def pair_scores(sel: pa.Table, pair_on: str) -> np.ndarray:
    """The value that ranks samples within a group: the total reward or one named component."""
    if pair_on == "reward":
        return sel["reward"].to_numpy(zero_copy_only=False)
    return np.array([component_value(items, pair_on) for items in sel["rewards"].to_pylist()], dtype=np.float64)


def pair_order(categories: list[str], steps: int, per_step: int, balance: str, rng: np.random.Generator) -> list[list[int]]:
    """Pair indices for each optimizer step. 'none': epochs of a fixed-seed permutation of all pairs.
    'category': the categories in turn (each its own permutation, refilled when used up), so every
    category contributes about per_step / n_categories pairs per step however many pairs it has."""
    if balance == "none":
        order: list[int] = []
        out = []
        for _ in range(steps):
            if len(order) < per_step:
                order += rng.permutation(len(categories)).tolist()
            out.append(order[:per_step])
            order = order[per_step:]
        return out
    by_cat: dict[str, list[int]] = {}
    for i, c in enumerate(categories):
        by_cat.setdefault(c, []).append(i)
    names = sorted(by_cat)
    queues: dict[str, list[int]] = {c: [] for c in names}
    out, k = [], 0
    for _ in range(steps):
        batch = []
        for _ in range(per_step):
            c = names[k % len(names)]
            k += 1
            if not queues[c]:
                queues[c] = [by_cat[c][int(j)] for j in rng.permutation(len(by_cat[c]))]
            batch.append(queues[c].pop())
        out.append(batch)
    return out


class DPOEngine(EngineBase):
    def __init__(self, spec: RunSpec):
        super().__init__(spec)
        if self.cfg.dpo is None:
            raise OfflineError("the config has no `dpo` section; use the shapes_dpo experiment or dpo=best_worst")
        self.d = self.cfg.dpo
        root = f"{spec.table_uri.rsplit('/', 1)[0]}/{spec.run_id}"  # per run: a rerun under one name never reuses
        self.selection_uri = f"{root}/selection.lance"
        self.pairs_uri = f"{root}/pairs.lance"

    @property
    def final_dir(self) -> Path:
        return Path(self.spec.workdir) / "checkpoints" / self.spec.run_name / self.spec.run_id / FINAL

    # --- select -------------------------------------------------------------------------------
    def select(self, tables: list[PinnedTable]) -> dict | None:
        if _exists(self.selection_uri):
            return None
        rows = select_rows(tables, self.d)
        if rows.num_rows == 0:
            raise OfflineError(f"the filters select no scored rollouts from {[t.ref for t in tables]}; "
                               f"loosen dpo.iteration_range / policy_versions / reward_min / categories")
        _write_once(self.selection_uri, rows)
        return {"selected_rows": float(rows.num_rows), "selected_sources": float(len(tables))}

    # --- pair ---------------------------------------------------------------------------------
    def pair(self) -> dict | None:
        if _exists(self.pairs_uri):
            return None
        sel = lance.dataset(self.selection_uri).to_table()
        keys = _group_keys(sel)
        rewards = sel["reward"].to_numpy(zero_copy_only=False)
        scores = pair_scores(sel, self.d.pair_on)
        pairs = make_pairs(keys, scores, self.d.pairing, self.d.margin)
        if pairs.count == 0:
            raise OfflineError(f"no preference pairs: all {pairs.groups} groups are tied or below margin "
                               f"{self.d.margin}; lower dpo.margin or select more rollouts")
        w, lo = pairs.winner, pairs.loser
        take = lambda col, idx: sel[col].take(pa.array(idx))  # noqa: E731
        table = pa.table({
            "pair_id": pa.array(np.arange(pairs.count), pa.int64()),
            "prompt": take("prompt", w), "prompt_meta": take("prompt_meta", w),
            "source": take("source", w), "run_id": take("run_id", w), "iteration": take("iteration", w),
            "group_id": take("group_id", w),
            "winner_sample_id": take("sample_id", w), "loser_sample_id": take("sample_id", lo),
            "winner_reward": take("reward", w), "loser_reward": take("reward", lo),
            "margin": pa.array(scores[w] - scores[lo], pa.float32()),
        })
        _write_once(self.pairs_uri, table)
        return {"pairs": float(pairs.count), "pair_groups": float(pairs.groups),
                "groups_without_pair": float(pairs.groups_without_pair),
                "pair_reward_margin": float(np.mean(rewards[w] - rewards[lo]))}

    def _latents(self, pairs: pa.Table) -> tuple[torch.Tensor, torch.Tensor]:
        """Final latents of winners and losers, read by key from the pinned source versions."""
        out = {}
        for src in sorted(set(pairs["source"].to_pylist())):
            uri, _, v = src.rpartition("@")
            ids = set(pairs["winner_sample_id"].to_pylist()) | set(pairs["loser_sample_id"].to_pylist())
            runs = sorted(set(pairs["run_id"].to_pylist()))
            t = lance.dataset(uri, version=int(v)).to_table(
                columns=["run_id", "sample_id", "final_latent"],
                filter="run_id IN (" + ", ".join(f"'{r}'" for r in runs) + ")")
            lat = tensor_from(t["final_latent"])
            for i, (r, s) in enumerate(zip(t["run_id"].to_pylist(), t["sample_id"].to_pylist())):
                if s in ids:
                    out[(src, r, s)] = lat[i]
        key = lambda col: [(s, r, i) for s, r, i in zip(pairs["source"].to_pylist(), pairs["run_id"].to_pylist(),  # noqa: E731
                                                         pairs[col].to_pylist())]
        try:
            w = np.stack([out[k] for k in key("winner_sample_id")])
            lo = np.stack([out[k] for k in key("loser_sample_id")])
        except KeyError as exc:
            raise OfflineError(f"pair member {exc} is missing from its pinned source version") from None
        return torch.from_numpy(w.copy()), torch.from_numpy(lo.copy())

    # --- update -------------------------------------------------------------------------------
    def _set_start(self) -> None:
        """Initial weights (base or a registered version) and the frozen reference."""
        pol = self.policy
        if self.d.init != "base":
            pol.load_version(self._download(self.d.init), None)
        if self.d.reference != "base":
            pol.set_reference(load_weights(self._download(self.d.reference)))

    def _download(self, uri: str) -> Path:
        if not uri.startswith("models:/") or uri.count("/") != 2:
            raise OfflineError(f"{uri!r}: expected 'base' or models:/NAME/VERSION")
        name, version = uri[len("models:/"):].split("/")
        ref = self.tracker.version(name, int(version))
        return self.tracker.download(ref, Path(self.spec.workdir) / "cache" / "policies" / f"{name}-v{version}.dpo")

    def update(self, log_every: int = 1) -> tuple[CheckpointRef, dict | None]:
        if self.final_dir.exists():
            verify_checkpoint(self.final_dir)
            return CheckpointRef(str(self.final_dir), read_counters(self.final_dir)["checkpoint_id"], 0), None
        d, a = self.d, self.cfg.algorithm
        pairs = lance.dataset(self.pairs_uri).to_table()
        x_w, x_l = self._latents(pairs)
        self._set_start()
        pol, fam = self.policy, self.policy.family
        prompts = pairs["prompt"].to_pylist()
        cats = [json.loads(m).get("category", "") if m else "" for m in pairs["prompt_meta"].to_pylist()]
        uniq = sorted(set(prompts))
        with torch.no_grad():
            cond_all = fam.encode_prompts(uniq)
        pos = np.array([uniq.index(p) for p in prompts])
        opt = pol.ensure_optimizer(None)
        params = list(pol.trainable_parameters().values())
        n_train = fam.scheduler.config.num_train_timesteps
        rng = np.random.default_rng(self.cfg.run.seed)
        gen = torch.Generator().manual_seed(self.cfg.run.seed)
        plan = pair_order(cats, d.steps, d.pairs_per_step, d.balance, rng)
        t0 = time.perf_counter()
        history: list[dict] = []
        pol.module.train()
        for step in range(d.steps):
            idx = plan[step]
            b = len(idx)
            sigma = sample_sigmas(b, d.timesteps, gen, d.logit_mean, d.logit_std)
            noise = torch.randn((b, *x_w.shape[1:]), generator=gen)
            xt_w, v_w = noised(x_w[idx], noise, sigma)
            xt_l, v_l = noised(x_l[idx], noise, sigma)
            x = torch.cat([xt_w, xt_l])
            t = torch.cat([sigma, sigma]) * n_train
            cond = cond_all.select(torch.from_numpy(np.concatenate([pos[idx], pos[idx]])))
            with torch.no_grad():
                ref = velocity_error(pol.reference_velocity(x, t, cond), torch.cat([v_w, v_l]))
            err = velocity_error(fam.velocity(x.to(fam.dtype), t, cond), torch.cat([v_w, v_l]))
            loss, m = dpo_loss(err[:b], err[b:], ref[:b], ref[b:], d.beta)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
            opt.step()
            rec = {"dpo/loss": float(loss.detach()), "dpo/grad_norm": float(gnorm), **{f"dpo/{k}": float(v) for k, v in m.items()}}
            history.append(rec)
            if step % log_every == 0 or step == d.steps - 1:
                self.tracker.log_metrics(self.spec.run_id, rec, step=step)
            if step % 25 == 0 or step == d.steps - 1:
                log.info("step %d/%d  loss %.4f  implicit acc %.2f  margin %+.3f", step + 1, d.steps,
                         rec["dpo/loss"], rec["dpo/implicit_acc"], rec["dpo/implicit_margin"])
        pol.module.eval()
        seconds = time.perf_counter() - t0
        counters = {"iteration": 0, "optimizer_steps": d.steps, "pairs": len(prompts), "policy_version_in": 0,
                    "policy_model_in": self.d.init}
        ck = save_checkpoint(self.final_dir, pol.state(), opt.state_dict(), counters, self.spec.config)
        pol.mark(ck.checkpoint_id)
        first, last = history[0], history[-1]
        return ck, {"update_compute_s": seconds, "dpo/loss_first": first["dpo/loss"], "dpo/loss_last": last["dpo/loss"]}

    # --- publish ------------------------------------------------------------------------------
    def publish(self, ckpt: CheckpointRef) -> tuple[PolicyRef, dict | None]:
        done = self.tracker.find_version(self.spec.model_name, self.spec.run_id, 0)
        if done is not None:
            self.tracker.move_alias(done)
            return done, None
        verify_checkpoint(Path(ckpt.uri))
        ref = self.tracker.publish(self.spec.run_id, Path(ckpt.uri), 0, self.spec.model_name, ckpt.checkpoint_id,
                                   {"run_name": self.spec.run_name, "algorithm": "diffusion_dpo"})
        return ref, {"policy_version": ref.version}

    # --- evaluate -----------------------------------------------------------------------------
    def evaluate(self, ckpt: CheckpointRef, policy: PolicyRef) -> dict:
        """Held-out accuracy before (the starting policy) and after, with the shared evaluation; the
        published version is tagged with it and competes for the experiment's `champion` alias."""
        path = Path(self.spec.workdir) / "records" / self.spec.run_name / self.spec.run_id / "evaluation.json"
        if path.is_file():
            return json.loads(path.read_text())
        recipe = eval_recipe(self.cfg.sampling)
        pol = self.policy
        pol.load_version(None)
        self._set_start()
        before = evaluate(pol.family, "heldout", recipe, self.d.eval_per_category)
        pol.load_version(Path(ckpt.uri), ckpt.checkpoint_id)
        after = evaluate(pol.family, "heldout", recipe, self.d.eval_per_category)
        res = {"heldout_before": before["accuracy"], "heldout_after": after["accuracy"],
               "before": before, "after": after}
        metrics = {"heldout/accuracy_before": before["accuracy"], "heldout/accuracy": after["accuracy"],
                   **{f"heldout/{k}": v for k, v in after.items() if isinstance(v, float)}}
        if self.tracker.record_evaluation(policy, after["accuracy"], after["n"]):
            metrics["heldout/champion_version"] = float(policy.version)
        self.tracker.log_metrics(self.spec.run_id, metrics, step=self.d.steps)
        self.tracker.log_dict(self.spec.run_id, res, "evaluation.json")
        write_json_atomic(path, res)
        return res
