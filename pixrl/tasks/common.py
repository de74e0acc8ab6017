"""Shared plumbing for the stage tasks: time the stage and log its metrics to the MLflow run —
unless the stores showed the stage already complete (resume), in which case only what MLflow
lacks is logged from the stage's record, so metric steps stay continuous and never duplicated."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..engines import progress
from ..engines.local import LocalEngine, RunSpec, get_engine


@dataclass
class StageRun:
    engine: LocalEngine
    metrics: dict[str, float] | None = field(default_factory=dict)

    def record(self, metrics: dict | None) -> None:
        """Stage metrics, or None when the stage found its output already committed."""
        if metrics is None:
            self.metrics = None
        else:
            self.metrics.update(metrics)


@contextmanager
def stage(spec: RunSpec, name: str, iteration: int):
    progress.started(iteration, name)
    run = StageRun(get_engine(spec))
    t0 = time.perf_counter()
    yield run
    seconds = time.perf_counter() - t0
    if run.metrics is None:
        _log_if_lost(spec, run.engine, name, iteration)
        progress.skipped(iteration, name)
        return
    run.metrics[f"time/{name}_s"] = seconds
    run.engine.tracker.log_metrics(spec.run_id, run.metrics, step=iteration)
    progress.finished(spec.run_id, iteration, name, seconds, run.metrics)


def _log_if_lost(spec: RunSpec, engine: LocalEngine, name: str, iteration: int) -> None:
    """A stage found committed may have died before logging: log what its record holds and
    MLflow lacks (time/<stage>_s then is the compute time, without the commit)."""
    recorded = engine.recorded_metrics(name, iteration)
    if not recorded:
        return
    if f"{name}_compute_s" in recorded:
        recorded = {**recorded, f"time/{name}_s": recorded[f"{name}_compute_s"]}
    engine.tracker.log_missing_metrics(spec.run_id, recorded, step=iteration)
