"""MixGRPO and MixGRPO-Flash (Li et al. 2025; algorithms.md §5): ODE sampling outside a
sliding window of W SDE steps, and only the window's steps trained, in order.

- The window (step_schedules.mix_window) moves by `window_stride` every `iters_per_window`
  iterations (progressive) and rolls back to the start; or is drawn at random per iteration.
  Near the end of the grid it shrinks, as upstream's does; rows still hold W transitions (the
  missing ones padded, stored step −1), so one table carries every window of the run.
- The SDE inside the window is Flow-GRPO's (`--flow_grpo_sampling`, η = sampling.noise_level),
  or DanceGRPO's with sampling.sde_type=dance.
- One initial latent per group (init_same_noise): the group's rollouts agree up to the window.
- Per-group advantages with the unbiased std (+1e-8); with several rewards, MixGRPO's default
  is `advantage_aggr` — set reward.aggregate=advantage (the presets do).
- Loss: PPO-clip per window step, plus kl_coeff · ½·mean(Δ log π)² — an approx-KL to the
  rollout policy, not to a reference model (MixGRPO's default kl_coeff is 0).
- Flash: after the window's last step the remaining ODE steps are DPM-Solver++(2M) steps on
  a grid compressed to `compress_ratio` of the points (ode_solvers.compressed_tail).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from ..config.schema import SamplingConfig
from .advantages import GroupAdvantages, unbiased_group_advantages
from .base import register_algorithm
from .flow_grpo import FlowGRPO
from .losses import ppo_clip_loss
from .sampling import SamplerRecipe
from .step_schedules import mix_window


class MixGRPOSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    window_size: int = Field(4, ge=1, description="W SDE (trained) steps per iteration")
    window_strategy: Literal["progressive", "random"] = "progressive"
    iters_per_window: int = Field(25, ge=1, description="progressive: iterations before the window moves")
    window_stride: int = Field(1, ge=0, description="progressive: steps the window moves (0: frozen at the start)")
    roll_back: bool = Field(True, description="progressive: restart at step 0 after the last window")
    clip_range: float = Field(1e-4, gt=0)
    adv_clip_max: float = Field(5.0, gt=0)
    std_eps: float = Field(1e-8, gt=0, description="added to the unbiased group std")
    kl_coeff: float = Field(0.0, ge=0, description="weight of ½·mean(Δ log π)², an approx-KL to the rollout policy")
    shared_noise: bool = Field(True, description="init_same_noise: one initial latent per group")
    filter_zero_advantage: bool = True


class MixGRPOFlashSettings(MixGRPOSettings):
    iters_per_window: int = Field(20, ge=1, description="progressive: iterations before the window moves")
    compress_ratio: float = Field(0.4, gt=0, le=1, description="the ODE steps after the window re-spaced onto "
                                  "this fraction of the grid points (DPM-Solver++ 2M)")


@register_algorithm("mix_grpo")
class MixGRPO(FlowGRPO):
    Settings = MixGRPOSettings

    @property
    def needs_reference(self) -> bool:
        return False

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        if sampling.window_size:
            raise ValueError(f"algorithm {self.name!r} places its own window (algorithm.window_size); unset "
                             f"sampling.window_size, which is Flow-GRPO-Fast's")
        if sampling.sde_type == "cps":
            raise ValueError(f"algorithm {self.name!r} samples its window with the Flow-GRPO SDE or DanceGRPO's; "
                             f"set sampling.sde_type=sde (or dance)")
        if sampling.noise_level <= 0:
            raise ValueError(f"algorithm {self.name!r} needs sampling.noise_level > 0 inside its window")
        if self.settings.window_size > sampling.steps - 2:
            raise ValueError(f"algorithm.window_size={self.settings.window_size} does not fit in the trainable steps "
                             f"0..{sampling.steps - 3} of sampling.steps={sampling.steps}")

    def window(self, sampling: SamplingConfig, rng: np.random.Generator, iteration: int) -> tuple[int, ...]:
        c = self.settings
        return mix_window(iteration, sampling.steps, c.window_size, c.iters_per_window, c.window_stride,
                          c.roll_back, c.window_strategy, rng)

    def rollout_recipe(self, sampling: SamplingConfig, rng: np.random.Generator, step: str,
                       iteration: int) -> SamplerRecipe:
        w = self.window(sampling, rng, iteration)
        return SamplerRecipe(sampling.steps, sampling.noise_level, sampling.sde_type, sampling.guidance_scale, w, w,
                             shared_noise=self.settings.shared_noise, stored_width=self.settings.window_size,
                             **self.ode_tail())

    def ode_tail(self) -> dict:
        return {}

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        return unbiased_group_advantages(rewards, group_ids, self.settings.std_eps, self.settings.adv_clip_max)

    def step_loss(self, tr, batch, adv, policy):
        c = self.settings
        old = policy.tensor(batch["log_probs"][:, tr.j])
        loss, metrics = ppo_clip_loss(tr.new.log_prob, old, adv, c.clip_range, c.adv_clip_max, tr.weight)
        if c.kl_coeff > 0:
            approx_kl = 0.5 * torch.mean((tr.new.log_prob - old) ** 2)
            loss = loss + c.kl_coeff * approx_kl
        return loss, metrics


@register_algorithm("mix_grpo_flash")
class MixGRPOFlash(MixGRPO):
    Settings = MixGRPOFlashSettings

    def ode_tail(self) -> dict:
        return {"ode_solver": "dpm2", "tail_compress": self.settings.compress_ratio}

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        super().check_sampling(sampling, step)
        if sampling.cfg_truncation < 1 and self.settings.compress_ratio < 1:
            raise ValueError(f"sampling.cfg_truncation={sampling.cfg_truncation} counts the grid's steps, and "
                             f"{self.name!r} re-spaces its ODE tail (algorithm.compress_ratio="
                             f"{self.settings.compress_ratio}); set cfg_truncation=1 or compress_ratio=1")
