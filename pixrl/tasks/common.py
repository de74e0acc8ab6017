"""Shared plumbing for the stage tasks: time the stage, log its metrics to the MLflow run."""

from __future__ import annotations

import time
from contextlib import contextmanager

from ..engines import progress
from ..engines.local import RunSpec, get_engine


@contextmanager
def stage(spec: RunSpec, name: str, iteration: int):
    """Yields the engine and a metrics dict; logs metrics + wall seconds when the stage succeeds."""
    progress.started(iteration, name)
    engine = get_engine(spec)
    metrics: dict[str, float] = {}
    t0 = time.perf_counter()
    yield engine, metrics
    seconds = time.perf_counter() - t0
    metrics[f"time/{name}_s"] = seconds
    engine.tracker.log_metrics(spec.run_id, metrics, step=iteration)
    progress.finished(spec.run_id, iteration, name, seconds, metrics)
