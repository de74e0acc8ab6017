from prefect import task

from ..artifacts.tracking import PolicyRef
from ..engines.local import RunSpec, get_engine


@task(name="evaluate", persist_result=False)
def evaluate(spec: RunSpec, after: int, policy: dict) -> None:
    """Held-out accuracy after `after` iterations (logged at that step); best → alias champion."""
    engine = get_engine(spec)
    metrics = engine.evaluate(after, PolicyRef(**policy))
    engine.tracker.log_missing_metrics(spec.run_id, metrics, step=after)  # a rerun logs nothing twice
