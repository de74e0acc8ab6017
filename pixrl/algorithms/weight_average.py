"""Trainable weights an algorithm keeps in its state beside the policy (DiffusionNFT's sampling
policy, AWM's anchor, DGPO's EMA reference): their moving average and their saved form."""

from __future__ import annotations

import torch


def blend(old: dict[str, torch.Tensor] | None, weights: dict[str, torch.Tensor], d: float) -> dict[str, torch.Tensor]:
    """d·old + (1 − d)·weights per tensor, in float32, kept in the weights' dtype and device; old
    None: the weights themselves (an average that starts now)."""
    old = old if old is not None else weights
    return {k: (d * old[k].to(w.device).float() + (1 - d) * w.detach().float()).to(w.dtype) for k, w in weights.items()}


def on_host(weights: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """The weights as a checkpoint's algorithm state holds them (host memory), or None."""
    return None if weights is None else {k: v.detach().cpu() for k, v in weights.items()}
