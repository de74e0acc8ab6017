"""The offline DPO stages as thin Prefect tasks over the offline stage layer (references in,
references out). A stage whose output is already stored returns it and logs nothing again."""

from __future__ import annotations

from prefect import task

from ..artifacts.archive import PinnedTable
from ..artifacts.checkpoints import CheckpointRef
from ..artifacts.tracking import PolicyRef
from ..run import RunSpec
from ..stages.session import offline_stages


@task(name="select", persist_result=False, task_run_name="select")
def select(spec: RunSpec, sources: list[dict]) -> str:
    """Archived rows matching the filters, from the pinned source versions → selection.lance."""
    return offline_stages(spec).select([PinnedTable.from_dict(s) for s in sources])


@task(name="pair", persist_result=False, task_run_name="pair")
def pair(spec: RunSpec, selection_uri: str) -> str:
    """Winner/loser pairs within each prompt group → pairs.lance."""
    return offline_stages(spec).pair()


@task(name="update", persist_result=False, task_run_name="update")
def update(spec: RunSpec, pairs_uri: str) -> dict:
    """The offline algorithm's optimizer steps over the pairs → checkpoint."""
    return offline_stages(spec).update().to_dict()


@task(name="publish", persist_result=False, task_run_name="publish")
def publish(spec: RunSpec, checkpoint: dict) -> dict:
    """Checkpoint → registered version; alias `rollout` moves last."""
    return offline_stages(spec).publish(CheckpointRef(**checkpoint)).to_dict()


@task(name="evaluate", persist_result=False, task_run_name="evaluate")
def evaluate(spec: RunSpec, checkpoint: dict, policy: dict) -> dict:
    """Held-out accuracy of the starting and the trained policy (the dataset's evaluator)."""
    return offline_stages(spec).evaluate(CheckpointRef(**checkpoint), PolicyRef(**policy))
