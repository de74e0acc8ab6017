"""The online stage layer: what each stage of an RL iteration *means*, for every engine.

Every stage: ask the stores whether its output for (run, iteration) is committed (the table in
stages/completion.py) and return it if so; otherwise call the engine for the compute, validate,
write its record, commit once (a Lance version, a renamed checkpoint, a registered version) and
log its metrics. Engines compute; this layer decides, records and commits.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..algorithms.advantages import aggregated_advantages, part_reward_spread, per_part, stored_scores
from ..algorithms.base import build_algorithm
from ..algorithms.dynamic_sampling import batch_full, groups_with_signal, trained_mask
from ..algorithms.recipe import replay_recipe
from ..artifacts.batch import COT_FIELDS, RolloutBatch
from ..artifacts.checkpoints import CheckpointRef, save_checkpoint
from ..artifacts.retention import RunRetention
from ..artifacts.tracking import PolicyRef
from ..artifacts.trajectories import TableRef
from ..datasets.prompts import load_prompt_set, select_categories
from ..engines.assets import resolve_asset
from ..engines.base import Engine, PolicySource
from ..run import RunSpec
from . import progress
from .chaos import fault_point
from .completion import RunStores
from .decode_score import DecodeScoreStages
from .generate import GenerateStage
from .overlap import ScoringOverlap
from .plan import BatchPlan, make_plan, seed_of
from .profiling import StageProfiler
from .publish import evaluate_policy, evaluated_weights, publish_checkpoint
from .records import StageRecords, timed_stage
from .rollout_prefetch import RolloutPrefetch
from .stored_policies import stored_sources
from .reward_history import reward_history


class OnlineStages(GenerateStage, DecodeScoreStages):
    def __init__(self, spec: RunSpec, engine: Engine):
        self.spec, self.cfg, self.engine = spec, spec.cfg, engine
        self.stores = RunStores(spec)
        self.tracker, self.table = self.stores.tracker, self.stores.table
        self.records = StageRecords(spec.layout)
        self.algorithm = build_algorithm(self.cfg.algorithm)
        self.retention = RunRetention(self.tracker, spec.model_name, spec.run_id, self.cfg.run.retention,
                                      spec.layout.checkpoints)
        self.overlap = ScoringOverlap(engine, self.cfg.sampling.micro_batch) if self.cfg.reward.overlap else None
        self.prefetch = RolloutPrefetch()
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

    @cached_property
    def stored_sources(self) -> dict[str, PolicySource]:
        """The algorithm's stored policies (DiffusionOPD's teacher) as local checkpoints to load."""
        return stored_sources(self.algorithm, self.stores, self.cfg)

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
        schedule = ["timesteps", "sigmas"] if self.step_kind == "denoise" else []
        cot = COT_FIELDS if self.step_kind == "token" and self.cfg.sampling.cot_tokens else ()
        batch, recipe, prompt_sets = self.update_inputs(ref, iteration, ["sample_id", *sorted(self.algorithm.needs), *cot,
                                                                         "advantage", *schedule])
        row = {sid: i for i, sid in enumerate(batch["sample_id"])}
        rows = [[[row[sid] for sid in mb] for mb in step] for step in plan.steps]
        result = self.engine.train(self.source(policy), batch, rows, recipe, seed=seed_of(self.cfg.run.seed, iteration, 2),
                                   prompt_sets=prompt_sets, stored=self.stored_sources)
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

    def update_inputs(self, ref: TableRef, iteration: int, columns: list[str]):
        """(the iteration's rows with `columns` and what conditions their replay — prompts, source
        images, recipes, groups —, the replay recipe, each row's prompt set as the rollout encoded it)."""
        names = self.table.dataset(ref.version).schema.names
        stored = [c for c in ("source_image", "guidance_memory") if c in names]  # a source, a guider's memory
        cols = list(dict.fromkeys([*columns, "prompt", "recipe", "group_id", *stored]))
        batch = RolloutBatch.from_arrow(self._read(ref, iteration, cols))
        return batch, replay_recipe(batch["recipe"], self.step_kind, self.cfg.algorithm.train_cfg), \
            self._rounds(batch["group_id"])

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
