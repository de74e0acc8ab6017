"""The one table of what marks each stage of an iteration complete, and the checks built on it.

The stores are the source of truth (DESIGN §2): a stage is complete when its output is
committed. Resume (the stage layer's skip checks and the flow's fast-forward), `pixrl status`
and lineage (forks) all read this table — nowhere else decides it.

| stage    | complete when                                                        |
|----------|----------------------------------------------------------------------|
| generate | the iteration's rows are in the trajectory table                     |
| decode   | every row of the iteration has `image`                               |
| score    | every row has `rewards` and `reward`                                 |
| replay   | every row has `advantage`                                            |
| update   | the iteration's checkpoint directory exists (its manifest is checked |
|          | when it is used: a mismatch is CorruptCheckpoint, never a skip)      |
| publish  | a registered version of the run is tagged with the iteration         |

With dynamic sampling (`sampling.max_rounds` > 1) generate, decode and score run once per
sampling round; round r holds group slots [r·P, (r+1)·P) of the iteration (P prompts per
round), so their marks are read on those rows (`round_scope`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ..artifacts.checkpoints import CheckpointRef, read_counters, verify_checkpoint
from ..artifacts.tracking import PolicyRef, Tracker
from ..artifacts.trajectories import TableRef, TrajectoryStore
from ..config.schema import STAGES
from ..run import RunLayout, RunSpec


@dataclass(frozen=True)
class Mark:
    """What a stage's committed output is: `rows` appended, `columns` filled, a `checkpoint`
    directory renamed into place, or a registered model `version`."""

    kind: str
    columns: tuple[str, ...] = ()


MARKS: dict[str, Mark] = {
    "generate": Mark("rows"),
    "decode": Mark("columns", ("image",)),
    "score": Mark("columns", ("rewards", "reward")),
    "replay": Mark("columns", ("advantage",)),
    "update": Mark("checkpoint"),
    "publish": Mark("version"),
}
assert tuple(MARKS) == STAGES

#: the stages that run once per sampling round
ROUND_STAGES = ("generate", "decode", "score")

#: the trajectory columns each stage fills after generate (which writes every other column)
FILLED_BY: dict[str, tuple[str, ...]] = {s: m.columns for s, m in MARKS.items() if m.kind == "columns"}


def round_scope(prompts_per_round: int, rnd: int) -> str:
    """The rows of sampling round `rnd` of an iteration (a filter beside run and iteration)."""
    return f"group_id >= {rnd * prompts_per_round} AND group_id < {(rnd + 1) * prompts_per_round}"


def columns_complete(rows, stage: str) -> bool:
    """On an Arrow table of one iteration's rows: are the stage's columns filled everywhere?"""
    return rows.num_rows > 0 and all(rows[c].null_count == 0 for c in FILLED_BY[stage])


class RunStores:
    """The three stores of one run — trajectory table, checkpoints, MLflow — and what they hold."""

    def __init__(self, spec: RunSpec, tracker: Tracker | None = None):
        self.spec = spec
        self.layout: RunLayout = spec.layout
        self.table = TrajectoryStore(spec.table_uri)
        self.tracker = tracker or Tracker(spec.tracking_uri)

    @cached_property
    def run_artifact_uri(self) -> str:
        """The MLflow run's artifact root (fixed for the run's life: asked once)."""
        return self.tracker.artifact_uri(self.spec.run_id)

    @cached_property
    def logged_sample_grids(self) -> set[str]:
        """The sample grids (`samples/it_NNNN.png`) the MLflow run holds: listed once per process,
        then kept up to date by the report that logs them (one process writes a run: RunLock)."""
        return {a.path for a in self.tracker.client.list_artifacts(self.spec.run_id, "samples")}

    def latest(self) -> TableRef:
        return TableRef(self.table.uri, self.table.latest_version())

    def round_scope(self, rnd: int) -> str | None:
        """The rows of sampling round `rnd`; None (the whole iteration) when a run samples one
        round, whose groups may also be an algorithm's several parts (Algorithm.rollout_parts)."""
        s = self.spec.cfg.sampling
        return None if s.max_rounds == 1 else round_scope(s.prompts_per_iteration, rnd)

    def complete(self, stage: str, iteration: int, rnd: int = 0) -> bool:
        """`rnd`: the sampling round, for generate, decode and score (the later stages take
        every row of the iteration)."""
        mark = MARKS[stage]
        scope = self.round_scope(rnd) if stage in ROUND_STAGES else None
        if mark.kind == "rows":
            return self.table.count(self.spec.run_id, iteration, where=scope) > 0
        if mark.kind == "columns":
            n = self.table.count(self.spec.run_id, iteration, where=scope)
            where = " AND ".join(f"{c} IS NOT NULL" for c in mark.columns)
            if scope:
                where = f"({scope}) AND {where}"
            return n > 0 and self.table.count(self.spec.run_id, iteration, where=where) == n
        if mark.kind == "checkpoint":
            return self.layout.checkpoint(iteration).exists()
        return self.published(iteration) is not None

    def published(self, iteration: int) -> PolicyRef | None:
        return self.tracker.find_version(self.spec.model_name, self.spec.run_id, iteration)

    def checkpoint(self, iteration: int) -> CheckpointRef:
        """The committed checkpoint of `iteration`, verified (CorruptCheckpoint on a mismatch)."""
        d = self.layout.checkpoint(iteration)
        verify_checkpoint(d)
        return CheckpointRef(str(d), read_counters(d)["checkpoint_id"], iteration)

    # --- policy versions as local checkpoint directories --------------------------------------
    def policy_dir(self, policy: PolicyRef) -> Path | None:
        """A local directory holding `policy`'s weights (None = base weights): this run's own
        checkpoint when it wrote the version, else a download cached under the work directory."""
        if policy.version == 0:
            return None
        own = self._own_checkpoint(policy)
        if own is not None:  # this run wrote it: no second copy from the registry
            return own
        target = self.layout.policy_cache(policy.model_name, policy.version)
        if not (target / "counters.json").is_file():
            local = self.tracker.download(policy, target.parent / (target.name + ".dl"))
            if not target.exists():
                local.rename(target)
        return target

    def _own_checkpoint(self, policy: PolicyRef) -> Path | None:
        if policy.model_name != self.spec.model_name or not policy.checkpoint_id:
            return None
        if not (policy.source or "").rpartition("/")[2].startswith("it_"):
            return None
        d = self.layout.checkpoint(int(policy.source.rpartition("/it_")[2]))  # logged under checkpoints/it_NNNN
        try:
            if d.is_dir() and read_counters(d)["checkpoint_id"] == policy.checkpoint_id:
                return d
        except (OSError, ValueError, KeyError):
            pass
        return None
