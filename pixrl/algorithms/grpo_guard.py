"""GRPO-Guard (Wang et al. 2025; algorithms.md §3): Flow-GRPO with a normalised ratio.

Under Flow-GRPO the per-step ratio's mean sits below 1 (most at low-noise steps) and its spread
differs by step, so positive-advantage samples rarely meet the upper clip. RatioNorm re-centres
and rescales it per step, from the rollout's stored transition means μ_old:

    s       = mean_B(s_t) · mean_B(sqrt(−Δ))                       (one scalar per step)
    log ρ̃  = s · [ (log π_θ − log π_old) + mean_CHW (μ_θ − μ_old)² / (2 s²) ]
    L       = mean_B max(−A·ρ̃, −A·clip(ρ̃, 1 ± ε)) / mean_B(sqrt(−Δ))²      (the 1/|Δ| reweight)

If x' = μ_old + s·ε then log ρ̃ = mean_CHW(ε ⊙ (μ_θ − μ_old)): zero-mean over ε whatever the
noise scale, and exactly 0 at θ = old. Optional KL to the reference as Flow-GRPO's (β).
Defaults from flow_grpo's config/grpo_guard.py: every step stochastic, 9 of 10 trained,
per-group std, clip 2e-6 (OCR, GenEval) or 4e-6 (PickScore).
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from ..config.schema import SamplingConfig
from .advantages import GroupAdvantages, group_advantages
from .base import register_algorithm
from .flow_grpo import FlowGRPO, Transition


class GRPOGuardSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    clip_range: float = Field(2e-6, gt=0, description="on the normalised ratio")
    adv_clip_max: float = Field(5.0, gt=0)
    std_eps: float = Field(1e-4, gt=0)
    global_std: bool = False
    filter_zero_advantage: bool = True
    beta: float = Field(0.0, ge=0, description="KL-to-reference weight (Flow-GRPO's form)")


def normalised_log_ratio(new_log_prob: torch.Tensor, old_log_prob: torch.Tensor, new_mean: torch.Tensor,
                         old_mean: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """RatioNorm's log ρ̃ per sample: s·[Δ log π + mean_CHW (μ_θ − μ_old)²/(2s²)]."""
    bias = (new_mean - old_mean).pow(2).mean(dim=tuple(range(1, new_mean.ndim))) / (2 * s**2)
    return (new_log_prob - old_log_prob + bias) * s


@register_algorithm("grpo_guard")
class GRPOGuard(FlowGRPO):
    Settings = GRPOGuardSettings
    needs = FlowGRPO.needs | {"means"}

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        if sampling.sde_type == "cps":
            raise ValueError("algorithm 'grpo_guard' normalises a Gaussian step's log-ratio; CPS log-probs are "
                             "unnormalised — set sampling.sde_type=sde")
        if sampling.noise_level <= 0:
            raise ValueError("algorithm 'grpo_guard' needs stochastic steps: set sampling.noise_level > 0")

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        c = self.settings
        return group_advantages(rewards, group_ids, c.global_std, c.std_eps, c.adv_clip_max)

    def step_loss(self, tr: Transition, batch, adv: torch.Tensor, policy):
        c = self.settings
        sqrt_dt = torch.sqrt(policy.sigmas[tr.k] - policy.sigmas[tr.k + 1]).float()
        s = tr.new.std_dev_t.mean() * sqrt_dt
        old = policy.tensor(batch["log_probs"][:, tr.j])
        log_ratio = normalised_log_ratio(tr.new.log_prob, old, tr.new.mean, policy.tensor(batch["means"][:, tr.j]), s)
        ratio = torch.exp(log_ratio)
        a = torch.clamp(adv.float(), -c.adv_clip_max, c.adv_clip_max)
        if tr.weight is not None:  # the behaviour weight (run.staleness_weight_cap), positive: per row
            a = tr.weight.float() * a
        clipped = torch.clamp(ratio, 1.0 - c.clip_range, 1.0 + c.clip_range)
        loss = torch.maximum(-a * ratio, -a * clipped).mean() / sqrt_dt**2
        with torch.no_grad():
            metrics = {"approx_kl": 0.5 * ((tr.new.log_prob - old) ** 2).mean(),
                       "clipfrac": (torch.abs(ratio - 1.0) > c.clip_range).float().mean(),
                       "clipfrac_gt_one": (ratio - 1.0 > c.clip_range).float().mean(),
                       "clipfrac_lt_one": (1.0 - ratio > c.clip_range).float().mean(),
                       "ratio_mean": ratio.mean(), "ratio_min": ratio.min(), "ratio_max": ratio.max(),
                       "policy_loss": loss.detach()}
        if c.beta > 0:
            kl = self.reference_kl(tr, policy, tr.new.std_dev_t)
            loss = loss + c.beta * kl
            metrics["kl"] = kl.detach()
        return loss, metrics
