"""DanceGRPO (Xue et al. 2025; algorithms.md §4): the Dance SDE (Flow-GRPO's drift with a
constant diffusion coefficient η), one initial latent per group, a random subset of the stored
steps trained per micro-batch, per-group advantages with the unbiased std, PPO-clip, no KL;
with `best_of` (its HunyuanVideo recipe, `train_grpo_hunyuan.py`) only each group's best_of/2
highest- and best_of/2 lowest-advantage samples are trained.

The last step is deterministic: an Euler step to σ = 0 lands on x̂0 = x − σ·v, which is the
image DanceGRPO decodes ("latents = pred_original"), and is never trained (it drops it too).
All T − 1 stochastic transitions are stored; each micro-batch trains int((T − 1)·train_fraction)
of them, drawn from the update's seeded generator. Deviation: DanceGRPO draws them per sample,
where each sample is its own micro-batch; pixrl's micro-batches share one draw, so that every
trained step replays the rollout's exact batch geometry (ratio exactly 1).
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from ..config.schema import SamplingConfig
from .advantages import GroupAdvantages, unbiased_group_advantages
from .base import register_algorithm
from .flow_grpo import FlowGRPO
from .losses import ppo_clip_loss
from .sampling import SamplerRecipe


class DanceGRPOSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    clip_range: float = Field(1e-4, gt=0)
    adv_clip_max: float = Field(5.0, gt=0)
    std_eps: float = Field(1e-8, gt=0, description="added to the unbiased group std")
    train_fraction: float = Field(0.6, gt=0, le=1, description="DanceGRPO's timestep_fraction: the share of "
                                  "the T − 1 stochastic steps trained")
    shared_noise: bool = Field(True, description="init_same_noise: one initial latent per group")
    filter_zero_advantage: bool = True
    best_of: int | None = Field(None, ge=2, multiple_of=2, description="bestofn: train only each group's best_of/2 "
                                "highest- and best_of/2 lowest-advantage samples (its HunyuanVideo recipe: 8 of 24)")


@register_algorithm("dance_grpo")
class DanceGRPO(FlowGRPO):
    Settings = DanceGRPOSettings

    @property
    def needs_reference(self) -> bool:
        return False

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        if sampling.sde_type != "dance":
            raise ValueError(f"algorithm 'dance_grpo' samples with the Dance SDE (s_t ≡ η); set sampling.sde_type=dance "
                             f"(got {sampling.sde_type!r}), e.g. with the sampling preset dance_sde_cpu")
        if sampling.window_size:
            raise ValueError("algorithm 'dance_grpo' makes every step but the last stochastic; unset "
                             "sampling.window_size (Flow-GRPO-Fast's window)")
        if sampling.steps < 2:
            raise ValueError("algorithm 'dance_grpo' needs sampling.steps ≥ 2")
        best_of = getattr(self.settings, "best_of", None)
        if best_of and best_of > sampling.group_size:
            raise ValueError(f"algorithm.best_of={best_of} selects from each group of "
                             f"sampling.group_size={sampling.group_size}: set best_of ≤ group_size (DanceGRPO: 8 of 24)")

    def rollout_recipe(self, sampling: SamplingConfig, rng: np.random.Generator, step: str,
                       iteration: int) -> SamplerRecipe:
        stochastic = tuple(range(sampling.steps - 1))
        return SamplerRecipe(sampling.steps, sampling.noise_level, "dance", sampling.guidance_scale, stochastic,
                             stochastic, shared_noise=self.settings.shared_noise)

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        return unbiased_group_advantages(rewards, group_ids, self.settings.std_eps, self.settings.adv_clip_max)

    def trains_on(self, advantages: np.ndarray, group_ids: np.ndarray | None = None) -> np.ndarray:
        """FlowGRPO's mask; with best_of, only each group's extremes by advantage (DanceGRPO's
        best-of-N: argsort, the last and the first best_of/2)."""
        keep = super().trains_on(advantages, group_ids)
        k = (getattr(self.settings, "best_of", None) or 0) // 2  # (DDPO, a subclass, has no best-of)
        if not k:
            return keep
        chosen = np.zeros(len(advantages), dtype=bool)
        for g in dict.fromkeys(np.asarray(group_ids).tolist()):
            idx = np.flatnonzero(np.asarray(group_ids) == g)
            order = idx[np.argsort(np.asarray(advantages)[idx], kind="stable")]
            chosen[order[:k]] = chosen[order[-k:]] = True
        return keep & chosen

    def _count(self, stored: int) -> int:
        return max(1, int(stored * self.settings.train_fraction))

    def terms(self, batch, trained_steps: frozenset[int] | None = None) -> int:
        n = len(self.trainable(batch, trained_steps))
        return self._count(n) if n else 0

    def trained_positions(self, batch, policy) -> list[int]:
        """A random permutation of the stored steps the trained weights denoise (the update's
        generator; all of them but for a two-expert checkpoint), its first n."""
        candidates = self.trainable(batch, policy.trained_steps)
        if not candidates:
            return []
        perm = torch.randperm(len(candidates), generator=policy.generator, device=policy.generator.device)
        return [candidates[int(i)] for i in perm[:self._count(len(candidates))].tolist()]

    def step_loss(self, tr, batch, adv, policy):
        c = self.settings
        return ppo_clip_loss(tr.new.log_prob, policy.tensor(batch["log_probs"][:, tr.j]), adv, c.clip_range,
                             c.adv_clip_max, tr.weight)
