"""Builds the sampler recipe for an iteration from the sampling config.

Plain Flow-GRPO: every step is stochastic and the first int(T · timestep_fraction) transitions
are trained (9 of 10: the last step to σ = 0 is excluded — its Gaussian is very sharp).
Flow-GRPO-Fast: one window of W SDE steps inside window_range, drawn once per iteration from
the run seed (so all members of a group share it); the other steps are ODE.
"""

from __future__ import annotations

import numpy as np

from ..config.schema import SamplingConfig
from .sampling import SamplerRecipe


def rollout_recipe(s: SamplingConfig, rng: np.random.Generator) -> SamplerRecipe:
    if s.window_size:
        lo, hi = s.window_range or (0, s.steps // 2)
        if hi - lo < s.window_size or hi > s.steps:
            raise ValueError(f"sampling.window_range={lo, hi} cannot hold a window of {s.window_size} "
                             f"in {s.steps} steps")
        start = int(rng.integers(lo, hi - s.window_size + 1))
        window = tuple(range(start, start + s.window_size))
        return SamplerRecipe(s.steps, s.noise_level, s.sde_type, s.guidance_scale, window, window)
    n_train = max(1, int(s.steps * s.timestep_fraction))
    return SamplerRecipe(s.steps, s.noise_level, s.sde_type, s.guidance_scale, None, tuple(range(n_train)))


def eval_recipe(s: SamplingConfig) -> SamplerRecipe:
    """Deterministic ODE sampling for evaluation (noise level 0, eval_steps)."""
    return SamplerRecipe(s.eval_steps, 0.0, "sde", s.guidance_scale, None, ())
