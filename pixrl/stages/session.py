"""One stage layer (and so one engine with its loaded model) per run per process: tasks of the
same run share it, and a new run replaces it so memory stays bounded."""

from __future__ import annotations

from ..engines.base import build_engine
from ..run import RunSpec
from .offline import OfflineStages
from .online import OnlineStages

_CURRENT: dict[tuple[str, type], object] = {}


def _stages(spec: RunSpec, kind: type):
    """The cached stage layer of this run, unless the spec changed (e.g. a replay under another
    config of the same run: it must not reuse the run's engine and its settings)."""
    key = (spec.run_id, kind)
    if key not in _CURRENT or _CURRENT[key].spec != spec:
        close_all()  # one run's model (and workers) at a time
        _CURRENT[key] = kind(spec, build_engine(spec.cfg))
    return _CURRENT[key]


def close_all() -> None:
    """Drop the cached stage layers, stopping their engines' workers (the Ray engine's actors)."""
    for stages in _CURRENT.values():
        if getattr(stages, "overlap", None) is not None:
            stages.overlap.close()  # reward.overlap's background thread
        close = getattr(stages.engine, "close", None)
        if close is not None:
            close()  # first: a rollout begun ahead (run.staleness) then ends with its workers
        if getattr(stages, "prefetch", None) is not None:
            stages.prefetch.close()
    _CURRENT.clear()


def release_workers() -> None:
    """At the end of a flow: stop engines that hold workers outside this process (Ray actors keep
    CPUs, GPUs and memory reserved); an in-process engine stays cached for the next flow."""
    if any(hasattr(stages.engine, "close") for stages in _CURRENT.values()):
        close_all()


def online_stages(spec: RunSpec) -> OnlineStages:
    return _stages(spec, OnlineStages)


def offline_stages(spec: RunSpec) -> OfflineStages:
    return _stages(spec, OfflineStages)
