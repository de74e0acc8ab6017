"""Stage start/end notifications (the CLI shows them with rich) and the stage timings the
iteration flow uses for its orchestration-overhead figure."""

from __future__ import annotations

from typing import Callable, Protocol


class Reporter(Protocol):
    def stage_started(self, iteration: int, stage: str) -> None: ...

    def stage_finished(self, iteration: int, stage: str, seconds: float, metrics: dict) -> None: ...

    def stage_skipped(self, iteration: int, stage: str) -> None: ...

    def evaluated(self, after: int, metrics: dict) -> None: ...


_reporters: list[Reporter] = []
_timings: dict[tuple[str, int], dict[str, float]] = {}


def add_reporter(r: Reporter) -> Callable[[], None]:
    _reporters.append(r)
    return lambda: _reporters.remove(r)


def started(iteration: int, stage: str) -> None:
    for r in list(_reporters):
        r.stage_started(iteration, stage)


def finished(run_id: str, iteration: int, stage: str, seconds: float, metrics: dict) -> None:
    _timings.setdefault((run_id, iteration), {})[stage] = seconds
    for r in list(_reporters):
        r.stage_finished(iteration, stage, seconds, metrics)


def skipped(iteration: int, stage: str) -> None:
    for r in list(_reporters):
        r.stage_skipped(iteration, stage)


def evaluated(after: int, metrics: dict) -> None:
    """A held-out evaluation of the policy after `after` iterations (metrics `heldout/...`)."""
    for r in list(_reporters):
        if hasattr(r, "evaluated"):
            r.evaluated(after, metrics)


def clear(run_id: str, iteration: int) -> None:
    _timings.pop((run_id, iteration), None)


def stage_seconds(run_id: str, iteration: int) -> dict[str, float]:
    return dict(_timings.get((run_id, iteration), {}))
