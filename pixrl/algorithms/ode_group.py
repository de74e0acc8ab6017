"""The rollout side the likelihood-free forward-process algorithms share (AWM, DGPO, V-GRPO, CRD):
deterministic ODE rollouts with the algorithm's solver, nothing but the final latents stored, and
Flow-GRPO's per-prompt group advantages — each algorithm keeps only its loss and its own state.

Every sample of every group is trained (a flat group carries advantage 0, not a skipped row), so
dynamic sampling's extra rounds are refused; only flow-matching (denoise) families have the
forward process these losses noise their samples with.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..config.schema import SamplingConfig
from .advantages import GroupAdvantages, group_advantages
from .base import Algorithm
from .recipe import ode_recipe
from .sampling import SamplerRecipe


class ODEGroupSettings(BaseModel):
    """The advantage and rollout keys of an ODE-rollout algorithm's `algorithm` section (each
    algorithm restates a default its paper sets differently)."""

    model_config = ConfigDict(extra="forbid")
    adv_clip_max: float = Field(5.0, gt=0)
    std_eps: float = Field(1e-4, gt=0)
    global_std: bool = Field(True, description="normalise by the batch's reward std instead of each group's")
    solver: Literal["euler", "dpm2"] = Field("dpm2", description="the rollout's ODE solver")


class ODEGroupAlgorithm(Algorithm):
    """An algorithm whose rollouts are the policy's ODE samples and whose advantages are per-prompt
    group ones; subclasses extend `check_sampling` with their own conditions."""

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        if step != "denoise":
            raise ValueError(f"algorithm {self.name!r} trains flow-matching (denoise) families")
        if sampling.max_rounds > 1:
            raise ValueError(f"algorithm {self.name!r} trains every sample of its ODE rollouts (a flat group's "
                             f"advantages are 0); set sampling.max_rounds=1")

    def rollout_recipe(self, sampling: SamplingConfig, rng: np.random.Generator, step: str,
                       iteration: int) -> SamplerRecipe:
        return ode_recipe(sampling, self.settings.solver)

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        c = self.settings
        return group_advantages(rewards, group_ids, c.global_std, c.std_eps, c.adv_clip_max)
