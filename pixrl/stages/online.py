"""The online stage layer: what each stage of an RL iteration *means*, for every engine.

Every stage: ask the stores whether its output for (run, iteration) is committed (the table in
stages/completion.py) and return it if so; otherwise call the engine for the compute, validate,
write its record, commit once (a Lance version, a renamed checkpoint, a registered version) and
log its metrics. Engines compute; this layer decides, records and commits.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..algorithms.advantages import aggregated_advantages, part_reward_spread, per_part, stored_scores
from ..algorithms.base import build_algorithm
from ..algorithms.dynamic_sampling import batch_full, groups_with_signal, trained_mask
from ..algorithms.recipe import replay_recipe, with_guidance
from ..algorithms.token_sampling import behavior_gap
from ..artifacts.batch import COT_FIELDS, RolloutBatch
from ..artifacts.rollout_rows import rows_table
from ..artifacts.checkpoints import CheckpointRef, save_checkpoint
from ..artifacts.retention import RunRetention
from ..artifacts.store_maintenance import maintain_store
from ..artifacts.tracking import PolicyRef
from ..artifacts.trajectories import TableRef, meta_json
from ..datasets.prompts import choose_prompts, load_prompt_set, select_categories
from ..engines.assets import resolve_asset
from ..engines.base import Engine, PolicySource
from ..run import RunSpec
from . import progress
from .chaos import fault_point
from .completion import RunStores
from .decode_score import DecodeScoreStages
from .overlap import ScoringOverlap
from .plan import BatchPlan, make_plan, seed_of
from .profiling import StageProfiler
from .publish import evaluate_policy, evaluated_weights, publish_checkpoint
from .records import StageRecords, timed_stage
from .rollout_calls import RolloutCalls
from .reward_history import reward_history


class OnlineStages(DecodeScoreStages):
    def __init__(self, spec: RunSpec, engine: Engine):
        self.spec, self.cfg, self.engine = spec, spec.cfg, engine
        self.stores = RunStores(spec)
        self.tracker, self.table = self.stores.tracker, self.stores.table
        self.records = StageRecords(spec.layout)
        self.algorithm = build_algorithm(self.cfg.algorithm)
        self.retention = RunRetention(self.tracker, spec.model_name, spec.run_id, self.cfg.run.retention,
                                      spec.layout.checkpoints)
        self.overlap = ScoringOverlap(engine, self.cfg.sampling.micro_batch) if self.cfg.reward.overlap else None
        self.profiler = StageProfiler(self.cfg.run.profile, spec.layout.records,
                                      lambda d, path: self.tracker.client.log_artifacts(spec.run_id, d, path))

    @cached_property
    def step_kind(self) -> str:
        """What one action of the configured family is ("denoise" or "token"): which fields its
        rollouts store and which of them decode reads. A class attribute: nothing is loaded."""
        from ..models.registry import get_family

        return get_family(self.cfg.model.family).semantics.step.value

    @cached_property
    def prompt_items(self):
        d = self.cfg.dataset
        return select_categories(load_prompt_set(resolve_asset(d.path), d.name), d.categories)

    def source(self, policy: PolicyRef) -> PolicySource:
        return PolicySource(self.stores.policy_dir(policy), policy.checkpoint_id)

    def _read(self, ref: TableRef, iteration: int, columns: list[str], where: str | None = None):
        return self.table.read(ref, self.spec.run_id, iteration, columns, where)

    @staticmethod
    def stage_name(stage: str, rnd: int) -> str:
        """A stage's name in records, progress and timings: `generate`, or `generate.r1` for
        dynamic sampling's second round (whose metrics are logged under `r1/`)."""
        return stage if rnd == 0 else f"{stage}.r{rnd}"

    def _commit_record(self, stage: str, iteration: int, rnd: int, metrics: dict) -> dict:
        """The stage's record before its commit; a later round's metrics keyed `r<k>/…` so that
        no MLflow key is logged twice at one step."""
        if rnd:
            metrics = {f"r{rnd}/{k}": v for k, v in metrics.items()}
        return self.records.before_commit(self.stage_name(stage, rnd), iteration, metrics)

    def _timed(self, name: str, iteration: int, compute):
        """Run `compute() -> (result, metrics | None)` as stage `name`, logging its metrics."""
        with self.profiler.stage(name, iteration) as profiled, \
                timed_stage(self.tracker, self.spec.run_id, name, iteration,
                            lambda: self.recorded_metrics(name, iteration)) as st:  # the trace is written after
            result, metrics = compute()
            profiled.keep = metrics is not None  # found complete: nothing was computed to profile
            st.record(metrics)
        return result

    # --- generate -----------------------------------------------------------------------------
    def generate(self, iteration: int, policy: PolicyRef, rnd: int = 0) -> TableRef:
        return self._timed(self.stage_name("generate", rnd), iteration, lambda: self._generate(iteration, policy, rnd))

    def _draws(self, iteration: int, rnd: int):
        """The prompts of sampling round `rnd` and the iteration's sampler recipes, one per part
        (round 0's draw: every row of an iteration is replayed with its part's recipe)."""
        cfg, s = self.cfg, self.cfg.sampling
        rng = np.random.default_rng(seed_of(cfg.run.seed, iteration, 0))
        prompts = choose_prompts(self.prompt_items, s.prompts_per_iteration, rng)
        parts = [with_guidance(p, s) for p in self.algorithm.rollout_parts(s, rng, self.step_kind, iteration)]
        if rnd:
            rng = np.random.default_rng(seed_of(cfg.run.seed, iteration, 0, rnd))
            prompts = choose_prompts(self.prompt_items, s.prompts_per_iteration, rng)
        return prompts, parts

    def _layout(self, rnd: int, prompts, parts: list) -> tuple[list, list[tuple]]:
        """Rows (group slot, member, prompt) in generation order, and (recipe, first row, end) per
        part: part i's group of prompt k is slot r·P + i·P + k (round r holds slots [r·P, (r+1)·P)
        with one part; an algorithm in parts samples one round)."""
        P, G = self.cfg.sampling.prompts_per_iteration, self.cfg.sampling.group_size
        first = rnd * P
        rows = [(first + i * P + k, g, p) for i in range(len(parts)) for k, p in enumerate(prompts) for g in range(G)]
        n = len(prompts) * G
        return rows, [(rec, i * n, (i + 1) * n) for i, rec in enumerate(parts)]

    def _noise_seeds(self, iteration: int, rnd: int, rows, recipe) -> list[int] | None:
        """The seeds of shared initial latents (recipe.shared_noise): one per group, or with
        `shared_members` one per prompt and member block, the same in every part."""
        if not getattr(recipe, "shared_noise", False):
            return None
        P, K = self.cfg.sampling.prompts_per_iteration, recipe.shared_members
        at = lambda slot, g: (rnd * P + (slot - rnd * P) % P, *((g // K,) if K else ()))  # noqa: E731  (prompt, block)
        return [seed_of(self.cfg.run.seed, iteration, 3, *at(slot, g)) for slot, g, _ in rows]

    def _generate(self, iteration: int, policy: PolicyRef, rnd: int):
        if self.stores.complete("generate", iteration, rnd):
            return self.stores.latest(), None
        if self.table.exists() and rnd == 0:  # index new fragments, drop stale versions: stage cost stays flat
            maintain_store(self.table, iteration)
        prompts, parts = self._draws(iteration, rnd)
        rows, calls = self._layout(rnd, prompts, parts)
        seeds = [seed_of(self.cfg.run.seed, iteration, 1, slot, g) for slot, g, _ in rows]
        noise_seeds = self._noise_seeds(iteration, rnd, rows, parts[0])  # a group's members start from one latent
        info = self.engine.describe()
        columns = self._row_columns(iteration, policy, rows, seeds, calls, info)
        if noise_seeds:
            columns["noise_seed"] = noise_seeds
        images = [p.image for _, _, p in rows] if any(p.image is not None for _, _, p in rows) else None
        if images is not None:  # an editing dataset: each row keeps the source image it was conditioned on
            columns["source_image"] = images
        call = RolloutCalls(self.source(policy), [p.prompt for _, _, p in rows], seeds, noise_seeds, images, calls)
        scope, video = self.stores.round_scope(rnd), bool(info.get("video"))
        to_store = getattr(self.engine, "rollout_to_store", None)  # workers write their rows themselves
        in_process = self.overlap is not None or to_store is None  # this process stores the rows
        extra = {}
        if in_process:
            batch, seconds = self._rollout_here((iteration, rnd), call, columns)
            table = rows_table(batch, columns, video, self.step_kind)
            if "cot_behavior_log_probs" in batch:  # the text came from a server: how far it is from the policy
                extra = behavior_gap(batch["cot_log_probs"], batch["cot_behavior_log_probs"], batch["cot_mask"])
        else:
            self.table.ensure_absent(self.spec.run_id, iteration, scope)  # before any worker writes
            create = not self.table.exists()
            fragments, schema, seconds = call.to_store(to_store, self.table.uri, columns, video, self.step_kind, create)
        metrics = self._commit_record("generate", iteration, rnd,
                                      {"images_per_s": len(rows) / seconds, "generate_compute_s": seconds, **extra})
        if in_process:
            ref = self.table.append(table, where=scope)
        else:
            ref = self.table.commit_appended(fragments, schema, create, self.spec.run_id, iteration, scope)
        if self.overlap is not None:
            self.overlap.committed((iteration, rnd), ref.version)
        self.table.tag(f"{self.spec.run_name}-it{iteration}-{self.stage_name('generate', rnd)}", ref.version)
        return ref, metrics

    def _rollout_here(self, key, call: RolloutCalls, columns: dict):
        """The rollout in this process; with reward.overlap each micro-batch is decoded and scored
        while the next one generates (a failed rollout discards what was begun)."""
        hook = None
        if self.overlap is not None:
            metas = [json.loads(m) for m in columns["prompt_meta"]]  # as score reads them
            for meta, image in zip(metas, call.images or ()):
                meta["source_image"] = image
            hook = self.overlap.begin(key, columns["sample_id"], columns["prompt"], metas)
        try:
            return call.rollout(self.engine, hook)
        except BaseException:
            if self.overlap is not None:
                self.overlap.discard(key)
            raise

    def _row_columns(self, iteration: int, policy: PolicyRef, rows, seeds: list[int], calls, info: dict) -> dict:
        """The stage's per-row columns of generate: keys, prompt, group, seed, policy version,
        family facts and the sampler recipe of the row's part (JSON)."""
        cfg, s = self.cfg, self.cfg.sampling
        n, sem = len(rows), info["semantics"]
        if self.step_kind == "token":
            geometry = {"resolution": info["resolution"], "image_tokens": info["image_tokens"]}
        else:
            geometry = {"resolution": list(info["latent_shape"])}
        recipes = []
        for recipe, lo, hi in calls:
            recipes += [json.dumps({**recipe.to_dict(), **geometry, "dtype": cfg.model.dtype,
                                    "engine": cfg.run.engine, "torch": info["torch"], "micro_batch": s.micro_batch,
                                    "shift": info.get("shift"), **({"frames": info["frames"]} if info.get("video") else {}),
                                    **({"cot_backend": "vllm", "cot_server": s.cot_vllm_url}
                                       if s.cot_tokens and s.cot_backend == "vllm" else {})})] * (hi - lo)
        return dict(
            run_id=[self.spec.run_id] * n, iteration=[iteration] * n,
            sample_id=[f"{iteration:05d}-{slot:03d}-{g:02d}" for slot, g, _ in rows],
            prompt_id=[p.prompt_id for _, _, p in rows], prompt=[p.prompt for _, _, p in rows],
            prompt_meta=[meta_json(p.meta) for _, _, p in rows], group_id=[slot for slot, _, _ in rows],
            sample_index=[g for _, g, _ in rows], seed=seeds, policy_version=[policy.version] * n,
            family=[info["family"]] * n, regime=[sem.regime.value] * n, step_kind=[sem.step.value] * n,
            recipe=recipes)

    # --- replay -------------------------------------------------------------------------------
    def replay(self, iteration: int, ref: TableRef) -> tuple[TableRef, BatchPlan]:
        return self._timed("replay", iteration, lambda: self._replay(iteration, ref))

    PLAN_COLUMNS = ["sample_id", "group_id", "reward", "advantage"]

    def _plan(self, t: pa.Table, advantages: np.ndarray | None = None) -> BatchPlan:
        """The update's micro-batches from the iteration's stored rows (PLAN_COLUMNS): the samples
        the algorithm trains on — with dynamic sampling, of the first P groups with signal."""
        adv = t["advantage"].to_numpy() if advantages is None else advantages
        keep = self.algorithm.trains_on(adv, t["group_id"].to_numpy())
        if self.cfg.sampling.max_rounds > 1:
            keep = keep & trained_mask(t["reward"].to_numpy(), t["group_id"].to_numpy(),
                                       self.cfg.sampling.prompts_per_iteration)
        return make_plan(t["sample_id"].to_pylist(), keep, self.cfg.sampling.micro_batch,
                         self.cfg.algorithm.optimizer_steps_per_iteration, self._rounds(t["group_id"].to_numpy()),
                         self.algorithm.passes)

    def _rounds(self, group_ids: np.ndarray) -> np.ndarray:
        """Each sample's engine call at rollout — its dynamic-sampling round, or its part of an
        iteration in parts: one prompt encoding set, and no micro-batch spans two."""
        return np.asarray(group_ids, dtype=np.int64) // self.cfg.sampling.prompts_per_iteration

    # --- dynamic sampling (sampling.max_rounds > 1) -------------------------------------------
    def needs_round(self, iteration: int, rnd: int) -> bool:
        """Whether sampling round `rnd` runs: the rounds before it are scored and hold fewer than
        P groups with signal (or it was begun already: resume and forks finish what is stored)."""
        if rnd >= self.cfg.sampling.max_rounds:
            return False
        if self.stores.complete("generate", iteration, rnd):
            return True
        t = self._read(self.stores.latest(), iteration, ["group_id", "reward"])
        if t["reward"].null_count:
            raise RuntimeError(f"iteration {iteration} has unscored samples before sampling round {rnd}; "
                               f"run score first")
        return not batch_full(t["reward"].to_numpy(), t["group_id"].to_numpy(), self.cfg.sampling.prompts_per_iteration)

    def _sampling_metrics(self, t: pa.Table, plan: BatchPlan) -> dict:
        P = self.cfg.sampling.prompts_per_iteration
        group_ids = t["group_id"].to_numpy()
        signal = len(groups_with_signal(t["reward"].to_numpy(), group_ids))
        group_of = dict(zip(t["sample_id"].to_pylist(), group_ids.tolist()))
        trained = len({group_of[sid] for step in plan.steps for mb in step for sid in mb})
        return {"sampling/rounds": float(int(group_ids.max()) // P + 1), "sampling/groups": float(len(set(group_ids))),
                "sampling/groups_with_signal": float(signal), "sampling/groups_trained": float(trained),
                "sampling/groups_short": float(max(0, P - signal))}

    def _replay(self, iteration: int, ref: TableRef):
        if self.stores.complete("replay", iteration):
            return (self.stores.latest(), self._plan(self._read(self.stores.latest(), iteration, self.PLAN_COLUMNS))), None
        t = self._read(ref, iteration, ["run_id", "iteration", "sample_id", "group_id", "prompt", "reward", "rewards"])
        rewards = t["reward"].to_numpy(zero_copy_only=False)
        if np.any(np.isnan(rewards)) or t["reward"].null_count:
            raise RuntimeError(f"iteration {iteration} has unscored samples; run score first")
        r, group_ids = self.cfg.reward, t["group_id"].to_numpy()
        parts = len(self._draws(iteration, 0)[1])  # each part normalised on its own
        estimate = per_part(self.algorithm.advantages, self._rounds(group_ids)) if parts > 1 else self.algorithm.advantages
        if (parts_w := r.advantage_parts()) is not None:
            components = stored_scores(t["rewards"].to_pylist(), parts_w, t["sample_id"].to_pylist())
            adv = aggregated_advantages(estimate, components, parts_w, group_ids)
        elif names := self.algorithm.advantage_scores():
            scores = stored_scores(t["rewards"].to_pylist(), names, t["sample_id"].to_pylist())
            adv = self.algorithm.advantages(rewards, group_ids, scores=scores)
        elif self.algorithm.reward_history:
            adv = self.algorithm.advantages(rewards, t["group_id"].to_numpy(), prompts=t["prompt"].to_pylist(),
                                            history=reward_history(self.table, ref.version, self.tracker, self.spec.run_id,
                                                                   iteration))
        else:
            adv = estimate(rewards, group_ids)
        upd = pa.table({"run_id": t["run_id"], "iteration": t["iteration"], "sample_id": t["sample_id"],
                        "advantage": pa.array(adv.advantages, pa.float32())})
        plan = self._plan(t, adv.advantages)
        metrics = {"zero_std_ratio": adv.zero_std_ratio, "advantage/mean": float(adv.advantages.mean()),
                   "advantage/std": float(adv.advantages.std()), "advantage/abs_max": float(np.abs(adv.advantages).max()),
                   "samples_trained": float(sum(len(mb) for step in plan.steps for mb in step))}
        if self.cfg.sampling.max_rounds > 1:
            metrics.update(self._sampling_metrics(t, plan))
        if parts > 1:
            metrics.update(part_reward_spread(rewards, group_ids, self._rounds(group_ids)))
        self.records.before_commit("replay", iteration, metrics)
        return (self.table.merge(upd), plan), metrics

    # --- update -------------------------------------------------------------------------------
    def update(self, iteration: int, ref: TableRef, plan: BatchPlan, policy: PolicyRef) -> CheckpointRef:
        return self._timed("update", iteration, lambda: self._update(iteration, ref, plan, policy))

    def _update(self, iteration: int, ref: TableRef, plan: BatchPlan, policy: PolicyRef):
        if self.stores.complete("update", iteration):  # a checksum mismatch raises CorruptCheckpoint
            return self.stores.checkpoint(iteration), None
        return self.train_into(iteration, ref, plan, policy, self.spec.layout.checkpoint(iteration), record=True)

    def train_into(self, iteration: int, ref: TableRef, plan: BatchPlan, policy: PolicyRef, out_dir: Path,
                   record: bool) -> tuple[CheckpointRef, dict]:
        """The update of `iteration` from its stored rows into `out_dir` (the run's checkpoint, or
        a replay's scratch directory when record=False: nothing of the run's is written then)."""
        a = self.cfg.algorithm
        schedule = ["timesteps", "sigmas"] if self.step_kind == "denoise" else []
        cot = COT_FIELDS if self.step_kind == "token" and self.cfg.sampling.cot_tokens else ()
        cols = ["sample_id", "prompt", *sorted(self.algorithm.needs), *cot, "advantage", *schedule, "recipe", "group_id",
                *(["source_image"] if "source_image" in self.table.dataset(ref.version).schema.names else [])]
        batch = RolloutBatch.from_arrow(self._read(ref, iteration, list(dict.fromkeys(cols))))
        row = {sid: i for i, sid in enumerate(batch["sample_id"])}
        rows = [[[row[sid] for sid in mb] for mb in step] for step in plan.steps]
        recipe = replay_recipe(batch["recipe"], self.step_kind, a.train_cfg)
        result = self.engine.train(self.source(policy), batch, rows, recipe, seed=seed_of(self.cfg.run.seed, iteration, 2),
                                   prompt_sets=self._rounds(batch["group_id"]))  # as the rollout encoded them
        counters = {"iteration": iteration, "optimizer_steps": len(plan.steps), "policy_version_in": policy.version,
                    "policy_model_in": policy.model_name}
        try:
            if record:
                self.records.before_commit("update", iteration, result.metrics)
            ck = save_checkpoint(out_dir, result.weights, result.optimizer, counters, self.spec.config, result.ema)
        except BaseException:
            self.engine.invalidate()  # the engine holds stepped weights that no checkpoint has
            raise
        self.engine.mark(ck.checkpoint_id)
        return ck, result.metrics

    def update_into(self, iteration: int, policy: PolicyRef, out_dir: Path) -> CheckpointRef:
        """Recompute iteration's update from its stored trajectories and advantages into out_dir,
        leaving the run's own checkpoint and records alone (replay / audit)."""
        latest = self.stores.latest()
        t = self._read(latest, iteration, self.PLAN_COLUMNS)
        if t.num_rows == 0 or t["advantage"].null_count:
            raise RuntimeError(f"iteration {iteration} of run {self.spec.run_name!r} has no complete replay stage "
                               f"in {self.table.uri}; nothing to recompute")
        plan = self._plan(t)
        try:
            ck, _ = self.train_into(iteration, latest, plan, policy, out_dir, record=False)
        finally:
            self.engine.invalidate()  # the in-memory weights are the replay's, not the run's
        return ck

    # --- publish ------------------------------------------------------------------------------
    def publish(self, iteration: int, ckpt: CheckpointRef) -> PolicyRef:
        return self._timed("publish", iteration, lambda: self._publish(iteration, ckpt))

    def _publish(self, iteration: int, ckpt: CheckpointRef):
        ref, new = publish_checkpoint(self.stores, iteration, ckpt, {},
                                      before_alias=lambda: fault_point("publish", iteration))
        self.retention.published(ref.version)
        if not new:
            return ref, None
        res = self.retention.apply()
        return ref, {"policy_version": ref.version, **res.metrics()}

    # --- evaluate (every run.eval_every iterations) -------------------------------------------
    def evaluate(self, after: int, policy: PolicyRef) -> dict:
        """Held-out accuracy of `policy` (the weights after `after` iterations) with the dataset's
        evaluator; tags the version with it and moves the experiment's alias `champion` to it when
        it beats the experiment's best so far. Done before: the record. Logged at step `after`."""
        metrics = self.records.read("evaluate", after)
        if metrics is None:
            res, champion = evaluate_policy(self.engine, self.stores, self.source(policy), policy,
                                            self.cfg.run.eval_per_category)
            metrics = {f"heldout/{k}": v for k, v in res.items() if isinstance(v, float)}
            if champion:
                metrics["heldout/champion_version"] = float(policy.version)
            if self.cfg.run.eval_trained and evaluated_weights(self.source(policy)).ema:  # beside its average
                raw = self.engine.evaluate(self.source(policy), self.cfg.dataset.name, "heldout",
                                           self.cfg.run.eval_per_category)
                metrics.update({f"heldout_trained/{k}": v for k, v in raw.items() if isinstance(v, float)})
            self.records.write("evaluate", after, metrics)
        self.tracker.log_missing_metrics(self.spec.run_id, metrics, step=after)  # a rerun logs nothing twice
        progress.evaluated(after, metrics)
        return metrics

    # --- records ------------------------------------------------------------------------------
    def recorded_metrics(self, stage: str, iteration: int) -> dict | None:
        """Metrics of a committed stage, for logging them if the process died before it could."""
        if stage == "publish":
            done = self.stores.published(iteration)
            return {"policy_version": done.version} if done else None
        return self.records.read(stage, iteration)
