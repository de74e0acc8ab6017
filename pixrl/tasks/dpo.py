"""The offline DPO stages as thin Prefect tasks over DPOEngine (references in, references out).
A stage whose output is already stored returns it and logs nothing again."""

from __future__ import annotations

from prefect import task

from ..artifacts.archive import PinnedTable
from ..artifacts.checkpoints import CheckpointRef
from ..artifacts.tracking import PolicyRef
from ..engines.local import RunSpec
from ..engines.offline import DPOEngine

_ENGINES: dict[str, DPOEngine] = {}


def _engine(spec: RunSpec) -> DPOEngine:
    if spec.run_id not in _ENGINES:
        _ENGINES.clear()
        _ENGINES[spec.run_id] = DPOEngine(spec)
    return _ENGINES[spec.run_id]


def _log(spec: RunSpec, metrics: dict | None, step: int = 0) -> None:
    if metrics:
        _engine(spec).tracker.log_metrics(spec.run_id, metrics, step=step)


@task(name="select", persist_result=False, task_run_name="select")
def select(spec: RunSpec, sources: list[dict]) -> str:
    """Archived rows matching the filters, from the pinned source versions → selection.lance."""
    _log(spec, _engine(spec).select([PinnedTable.from_dict(s) for s in sources]))
    return _engine(spec).selection_uri


@task(name="pair", persist_result=False, task_run_name="pair")
def pair(spec: RunSpec, selection_uri: str) -> str:
    """Winner/loser pairs within each prompt group → pairs.lance."""
    _log(spec, _engine(spec).pair())
    return _engine(spec).pairs_uri


@task(name="update", persist_result=False, task_run_name="update")
def update(spec: RunSpec, pairs_uri: str) -> dict:
    """Diffusion-DPO steps over the pairs → checkpoint."""
    ck, m = _engine(spec).update()
    _log(spec, m, step=spec.cfg.dpo.steps)
    return ck.to_dict()


@task(name="publish", persist_result=False, task_run_name="publish")
def publish(spec: RunSpec, checkpoint: dict) -> dict:
    """Checkpoint → registered version; alias `rollout` moves last."""
    ref, m = _engine(spec).publish(CheckpointRef(**checkpoint))
    _log(spec, m, step=spec.cfg.dpo.steps)
    return ref.to_dict()


@task(name="evaluate", persist_result=False, task_run_name="evaluate")
def evaluate(spec: RunSpec, checkpoint: dict, policy: dict) -> dict:
    """Held-out accuracy of the starting and the trained policy (the shared shapes evaluation)."""
    return _engine(spec).evaluate(CheckpointRef(**checkpoint), PolicyRef(**policy))
