"""Rollout correction: the tokens a text server sampled (`sampling.cot_backend=vllm`) come from its
distribution μ, not from the policy π_old that the update's ratio is taken against; at bf16 on a
GPU the two differ (the trainer/rollout mismatch of RL systems with a separate inference engine).
Importance weights ρ = π_old / μ, from the stored policy log-probs (`cot_log_probs`, teacher-
forced) and the server's own (`cot_behavior_log_probs`), correct the policy gradient:

- `token_truncate`: each token's loss weighted by min(ρ_t, C) (truncated importance sampling,
  the correction verl and ms-swift apply by default, C = 2);
- `token_mask`: tokens with ρ_t outside [C_low, C] are dropped — from the loss and from its
  denominator, so the rest are not scaled down — and the kept ones weighted by ρ_t (masked
  importance sampling);
- `sequence_truncate`, `sequence_mask`: the same with one ρ per sequence, exp(Σ_t log ρ_t) over its
  text tokens, applied to all of them.

Weights carry no gradient. Image tokens are the policy's own samples (weight 1).
"""

from __future__ import annotations

from typing import Literal

import torch

Mode = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def rollout_weights(old: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor, mode: Mode, high: float,
                    low: float | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(weights [B, C], kept [B, C] as the mask's dtype, metrics) of text tokens [B, C] whose
    `mask` marks the real ones; `low` (mask modes): the lower bound, 1/high when None."""
    with torch.no_grad():
        m = mask.to(old.dtype)
        log_ratio = (old - behavior) * m
        if mode.startswith("sequence"):
            log_ratio = log_ratio.sum(1, keepdim=True).expand_as(old)
        ratio = torch.exp(log_ratio.clamp(max=30.0))  # e^30: far past any threshold, and finite
        real = m > 0
        if mode.endswith("truncate"):
            weights, kept = ratio.clamp(max=high), real
        else:
            lo = 1.0 / high if low is None else low
            kept = real & (ratio >= lo) & (ratio <= high)
            weights = torch.where(kept, ratio, torch.zeros_like(ratio))
        n = m.sum().clamp(min=1)
        metrics = {"rollout_is/ratio_mean": (ratio * m).sum() / n,
                   "rollout_is/ratio_max": ratio[real].max() if real.any() else ratio.new_ones(()),
                   "rollout_is/weight_mean": (weights * kept).sum() / kept.sum().clamp(min=1),
                   "rollout_is/corrected_frac": ((ratio > high) & real).sum() / n
                   if mode.endswith("truncate") else (real & ~kept).sum() / n}
    return weights, kept.to(mask.dtype), metrics
