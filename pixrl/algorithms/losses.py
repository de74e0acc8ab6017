"""PPO-clip surrogate on per-step log-prob ratios (Flow-GRPO §2.6) and its diagnostics."""

from __future__ import annotations

import torch


def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float = 5.0,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """mean_batch max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε)), ρ = exp(log π − log π_old); with a positive
    per-sample `weight` w, mean max(−w·A·ρ, −w·A·clip(ρ)) (TempFlow-GRPO's noise-aware weighting).

    Returns the loss and detached diagnostics: approx_kl = ½·mean(Δ log π)², clipfrac, ratio stats.
    """
    adv = torch.clamp(advantages.float(), -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    if weight is not None:
        adv = weight.float() * adv
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        diff = log_prob - old_log_prob
        metrics = {
            "approx_kl": 0.5 * (diff**2).mean(),
            "clipfrac": (torch.abs(ratio - 1.0) > clip_range).float().mean(),
            "ratio_mean": ratio.mean(),
            "ratio_min": ratio.min(),
            "ratio_max": ratio.max(),
        }
    return loss, metrics
