"""What an advantage with memory reads (DDPO's per-prompt deque, `Algorithm.reward_history`):
each prompt's rewards in the run's earlier iterations, oldest first, from the trajectory store.
A fork's past is its parent's before the fork point — as of the parent table version the fork
pinned, and so on up its lineage — then its own; so a fork that recomputes an iteration's
advantages gets the parent's."""

from __future__ import annotations

import json

import numpy as np

from ..artifacts.trajectories import TrajectoryStore


def reward_history(store: TrajectoryStore, version: int | None, tracker, run_id: str,
                   iteration: int) -> dict[str, np.ndarray]:
    """prompt → its rewards in the iterations before `iteration`, oldest first."""
    out: dict[str, list[float]] = {}
    for prompt, reward in _earlier(store, version, tracker, run_id, iteration):
        out.setdefault(prompt, []).append(reward)
    return {p: np.asarray(v, np.float64) for p, v in out.items()}


def _earlier(store: TrajectoryStore, version: int | None, tracker, run_id: str, iteration: int) -> list:
    fork = tracker.client.get_run(run_id).data.tags.get("pixrl.fork")
    past = []
    if fork:
        f = json.loads(fork)
        past = _earlier(TrajectoryStore(f["parent_table_uri"]), f["parent_table_version"], tracker,
                        f["parent_run_id"], min(iteration, int(f["iteration"])))
    t = store.earlier(version, run_id, iteration, ["prompt", "reward"]) if version is not None else None
    if t is None:
        return past
    if t["reward"].null_count:
        raise RuntimeError(f"run {run_id}'s iterations before {iteration} hold unscored samples in {store.uri}; "
                           f"resume that run to finish them")
    return past + list(zip(t["prompt"].to_pylist(), t["reward"].to_pylist()))
