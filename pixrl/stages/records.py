"""Stage records and metric logging: what a stage measured survives a crash between its commit
and its MLflow logging.

Order inside every stage: compute → `before_commit` (write the record atomically, then the
fault-injection point) → commit → `log` to MLflow. A stage found complete on resume logs only
what MLflow lacks, from its record, so metric steps stay continuous and are never duplicated.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..artifacts.files import write_json_atomic
from ..artifacts.tracking import Tracker
from ..run import RunLayout
from . import progress
from .chaos import fault_point


class StageRecords:
    def __init__(self, layout: RunLayout):
        self.layout = layout

    def before_commit(self, stage: str, iteration: int, metrics: dict) -> dict:
        """Write the stage's metrics (replacing an uncommitted attempt's), then the fault point;
        the caller commits next."""
        write_json_atomic(self.layout.record(stage, iteration), metrics)
        fault_point(stage, iteration)
        return metrics

    def read(self, stage: str, iteration: int | None) -> dict | None:
        path = self.layout.record(stage, iteration)
        return json.loads(path.read_text()) if path.is_file() else None

    def write(self, stage: str, iteration: int | None, metrics: dict) -> None:
        write_json_atomic(self.layout.record(stage, iteration), metrics)


@dataclass
class StageRun:
    """Collects one stage's metrics; None means the stores showed it complete (nothing computed)."""

    metrics: dict[str, float] | None = field(default_factory=dict)

    def record(self, metrics: dict | None) -> None:
        if metrics is None:
            self.metrics = None
        else:
            self.metrics.update(metrics)


@contextmanager
def timed_stage(tracker: Tracker, run_id: str, name: str, iteration: int, recorded):
    """Time a stage, report it, and log its metrics at step `iteration`. `recorded()` gives the
    stage's record for the resume case (the stage was found complete)."""
    progress.started(iteration, name)
    run = StageRun()
    t0 = time.perf_counter()
    yield run
    seconds = time.perf_counter() - t0
    if run.metrics is None:
        _log_if_lost(tracker, run_id, name, iteration, recorded())
        progress.skipped(iteration, name)
        return
    run.metrics[f"time/{name}_s"] = seconds
    tracker.log_metrics(run_id, run.metrics, step=iteration)
    progress.finished(run_id, iteration, name, seconds, run.metrics)


def _log_if_lost(tracker: Tracker, run_id: str, name: str, iteration: int, recorded: dict | None) -> None:
    """A stage found committed may have died before logging: log what its record holds and
    MLflow lacks (time/<stage>_s then is the compute time, without the commit)."""
    if not recorded:
        return
    if f"{name}_compute_s" in recorded:
        recorded = {**recorded, f"time/{name}_s": recorded[f"{name}_compute_s"]}
    tracker.log_missing_metrics(run_id, recorded, step=iteration)
