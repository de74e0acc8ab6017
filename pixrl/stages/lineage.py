"""Past iterations as inputs: recompute one iteration's update and compare it with what was
recorded (`replay_update`), and seed a fork — a new run that starts at some iteration of a
parent run and reuses the parent's stored outputs of the stages before the fork point
(`seed_fork_rows`)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch
from safetensors.torch import load_file

from ..artifacts.checkpoints import EMA, WEIGHTS, CheckpointPruned, read_counters, require_full_checkpoint, verify_checkpoint
from ..artifacts.retention import describe
from ..artifacts.trajectories import TableRef, TrajectoryStore
from ..artifacts.tracking import PolicyRef
from ..config.schema import STAGES
from ..errors import ExpectedError
from ..run import RunSpec
from .completion import FILLED_BY
from .session import online_stages

FORKABLE = ("generate", "decode", "score", "replay", "update")


class LineageError(ExpectedError, RuntimeError):
    pass


@dataclass
class ReplayReport:
    iteration: int
    recorded: str
    equal: bool
    tensors: int
    differing: list[str]
    max_abs_diff: float

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def replay_update(spec: RunSpec, iteration: int, out_dir: Path | None = None) -> ReplayReport:
    """Re-run update for `iteration` from its stored trajectories and checkpoint iteration−1 (with
    its optimizer state) and compare the weights (and their average, algorithm.ema) with the
    recorded checkpoint `iteration`."""
    stages = online_stages(spec)
    recorded = spec.layout.checkpoint(iteration)
    if not recorded.is_dir():
        raise LineageError(f"run {spec.run_name!r} has no checkpoint for iteration {iteration} ({recorded}): "
                           f"retention ({describe(spec.cfg.run.retention)}) deleted it or the update never ran; "
                           f"`pixrl status {spec.run_name}` lists the complete iterations")
    verify_checkpoint(recorded)
    c = read_counters(recorded)
    version_in = int(c["policy_version_in"])
    model_in = c.get("policy_model_in", spec.model_name)
    policy = stages.tracker.version(model_in, version_in) if version_in else PolicyRef(model_in, 0)
    if version_in:  # the update starts from iteration−1's weights *and* optimizer state
        try:
            require_full_checkpoint(stages.stores.policy_dir(policy), f"replaying iteration {iteration}'s update")
        except CheckpointPruned as exc:
            raise LineageError(str(exc)) from None
    with tempfile.TemporaryDirectory(dir=spec.workdir) as tmp:
        target = Path(out_dir) if out_dir else Path(tmp) / "replayed"
        stages.update_into(iteration, policy, target)
        want, got = _weight_files(recorded), _weight_files(target)
    differing = sorted(k for k in want if k not in got or not torch.equal(want[k], got[k]))
    max_diff = max((float((want[k] - got[k]).abs().max()) for k in differing if k in got), default=0.0)
    return ReplayReport(iteration, str(recorded), not differing and set(want) == set(got), len(want),
                        differing, max_diff)


def _weight_files(ckpt: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's trained tensors, and its weight average's (algorithm.ema) prefixed `ema:`."""
    out = load_file(str(ckpt / WEIGHTS))
    if (ckpt / EMA).is_file():
        out.update({f"ema:{k}": v for k, v in load_file(str(ckpt / EMA)).items()})
    return out


def seed_fork_rows(parent: TrajectoryStore, parent_run_id: str, parent_version: int | None, iteration: int,
                   from_stage: str, child: TrajectoryStore, child_run_id: str) -> TableRef | None:
    """Copy the parent's rows of `iteration` (as of the pinned Lance version) into the child's
    table with the outputs of `from_stage` and later stages cleared, so the child's flow skips
    what came before and recomputes from `from_stage` on. Idempotent: rows already there stay."""
    if from_stage == "generate" or child.count(child_run_id, iteration):
        return None
    t = fork_rows(parent, parent_run_id, parent_version, iteration, from_stage)
    t = t.set_column(t.schema.get_field_index("run_id"), t.schema.field("run_id"),
                     pa.array([child_run_id] * t.num_rows, pa.string()))
    return child.append(t)


def fork_rows(parent: TrajectoryStore, parent_run_id: str, parent_version: int | None, iteration: int,
              from_stage: str) -> pa.Table | None:
    """The parent's rows a fork reuses, validated (called before the fork writes anything)."""
    if from_stage not in FORKABLE:
        raise LineageError(f"--from-stage must be one of {', '.join(FORKABLE)}, got {from_stage!r}")
    if from_stage == "generate":
        return None
    if parent_version is None:
        raise LineageError(f"the parent has no trajectory table at {parent.uri}; fork --from-stage generate")
    t = parent.dataset(parent_version).to_table(
        filter=f"run_id = '{parent_run_id}' AND iteration = {int(iteration)}")
    if t.num_rows == 0:
        raise LineageError(f"the parent table {parent.uri}@{parent_version} has no rows for iteration {iteration}")
    needed = [col for stage in STAGES[1:STAGES.index(from_stage)] for col in FILLED_BY.get(stage, ())]
    incomplete = [col for col in needed if t[col].null_count]
    if incomplete:
        raise LineageError(f"the parent's iteration {iteration} lacks {incomplete} at version {parent_version}; "
                           f"fork from an earlier stage")
    for stage in STAGES[STAGES.index(from_stage):]:
        for col in FILLED_BY.get(stage, ()):
            i = t.schema.get_field_index(col)
            t = t.set_column(i, t.schema.field(col), pa.nulls(t.num_rows, t.schema.field(col).type))
    return t
