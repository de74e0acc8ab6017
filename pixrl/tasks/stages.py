"""The online loop's stage tasks: thin Prefect wrappers (references in → references out) over
the stage layer, which owns the skip check, record, commit and metric logging."""

from __future__ import annotations

from prefect import task

from ..artifacts.checkpoints import CheckpointRef
from ..artifacts.tracking import PolicyRef
from ..artifacts.trajectories import TableRef
from ..run import RunSpec
from ..stages.plan import BatchPlan
from ..stages.session import online_stages


@task(name="generate", persist_result=False)
def generate(spec: RunSpec, iteration: int, policy: dict, rnd: int = 0) -> dict:
    """G samples per prompt with the given policy version → rows appended to Lance (`rnd`: the
    dynamic-sampling round)."""
    return online_stages(spec).generate(iteration, PolicyRef(**policy), rnd).to_dict()


@task(name="decode", persist_result=False)
def decode(spec: RunSpec, iteration: int, table: dict, rnd: int = 0) -> dict:
    """Final latents → PNG images in the same rows."""
    return online_stages(spec).decode(iteration, TableRef(**table), rnd).to_dict()


@task(name="score", persist_result=False)
def score(spec: RunSpec, iteration: int, table: dict, rnd: int = 0) -> dict:
    """Images → per-component and total rewards; NaN or a missing component fails loudly."""
    return online_stages(spec).score(iteration, TableRef(**table), rnd).to_dict()


@task(name="replay", persist_result=False)
def replay(spec: RunSpec, iteration: int, table: dict) -> dict:
    """Group advantages → `advantage` column; the training micro-batches as sample ids."""
    ref, plan = online_stages(spec).replay(iteration, TableRef(**table))
    return {"table": ref.to_dict(), "plan": plan.to_dict()}


@task(name="update", persist_result=False)
def update(spec: RunSpec, iteration: int, replayed: dict, policy: dict) -> dict:
    """Replay stored transitions through the current model, the algorithm's loss, optimizer steps → checkpoint."""
    ck = online_stages(spec).update(iteration, TableRef(**replayed["table"]), BatchPlan(**replayed["plan"]),
                                    PolicyRef(**policy))
    return ck.to_dict()


@task(name="publish", persist_result=False)
def publish(spec: RunSpec, iteration: int, checkpoint: dict) -> dict:
    """Checkpoint → registered version; alias `rollout` moves last."""
    return online_stages(spec).publish(iteration, CheckpointRef(**checkpoint)).to_dict()


@task(name="evaluate", persist_result=False)
def evaluate(spec: RunSpec, after: int, policy: dict) -> None:
    """Held-out accuracy after `after` iterations (logged at that step); best → alias champion."""
    online_stages(spec).evaluate(after, PolicyRef(**policy))
