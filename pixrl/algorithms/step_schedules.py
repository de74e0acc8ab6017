"""Which sampler steps are stochastic (and trained) in an iteration, per algorithm: pure
functions of the iteration and its seeded rng, so resume, replay and forks recompute them.

- MixGRPO's sliding window (`GRPOTrainingStates`, algorithms.md §5.1): a window of W SDE steps
  whose start moves by `stride` every `per_window` iterations ("progressive"), or is drawn at
  random each iteration; indices below max_t = T − 2 (the last two steps are never trained).
- Flow-DPPO's `AllSDEScheduler` (§8): n distinct steps drawn from a fraction of the grid.
"""

from __future__ import annotations

import numpy as np


def mix_window(iteration: int, steps: int, size: int, per_window: int, stride: int, roll_back: bool = True,
               strategy: str = "progressive", rng: np.random.Generator | None = None) -> tuple[int, ...]:
    """MixGRPO's window at `iteration` (0-based; the state after that many iterations).

    Progressive, as upstream: the start advances by `stride` (0: frozen) after `per_window`
    iterations in a window; past the end it rolls back to 0 (roll_back) or stays at the end.
    Deviation: upstream rolls back only once the start exceeds max_t, so the start max_t itself
    gives an empty window for `per_window` iterations (which trains nothing, and crashes its
    Flash sampler); pixrl rolls back (or stops) at the last non-empty window instead."""
    max_t = steps - 2
    if size < 1 or max_t < 1:
        raise ValueError(f"a MixGRPO window of {size} step(s) needs sampling.steps ≥ 3 (got {steps})")
    if strategy == "random":
        if rng is None:
            raise ValueError("the random window strategy needs the iteration's rng")
        start = int(rng.integers(0, max(1, max_t - size + 1)))
        return tuple(range(start, min(start + size, max_t)))
    if strategy != "progressive":
        raise ValueError(f"unknown window strategy {strategy!r}; choose 'progressive' or 'random'")
    start, spent = 0, 0
    for _ in range(iteration):
        spent += 1
        if spent >= per_window:
            spent = 0
            start += stride
        if start >= max_t:
            start, spent = (0, 0) if roll_back else (max_t - 1, spent)
    return tuple(range(start, min(start + size, max_t)))


def random_sde_steps(steps: int, count: int, fraction: tuple[float, float], rng: np.random.Generator) -> tuple[int, ...]:
    """Flow-DPPO's AllSDEScheduler: `count` distinct steps from range(int(T·f0), int(T·f1)),
    sorted; the whole pool when count ≥ its size."""
    lo, hi = int(steps * fraction[0]), int(steps * fraction[1])
    pool = np.arange(lo, hi)
    if len(pool) == 0:
        raise ValueError(f"sde_fraction {fraction} of {steps} steps holds no step; widen it")
    if count >= len(pool):
        return tuple(int(k) for k in pool)
    return tuple(sorted(int(k) for k in rng.choice(pool, count, replace=False)))
