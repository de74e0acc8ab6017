"""The miniatures' shared training-loop pieces: a warmup + cosine learning rate, and EMA weights."""

from __future__ import annotations

import math

import torch


def warmup_cosine(base: float, step: int, total: int, warmup: int, floor: float) -> float:
    """base · min(1, step/warmup) · (floor + (1 − floor)·½(1 + cos(π·step/total)))."""
    frac = step / total
    return base * min(1.0, step / warmup) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def ema_update(ema: list[torch.Tensor], live: list[torch.Tensor], step: int, decay: float) -> None:
    """ema ← lerp(ema, live, 1 − d), d = min(decay, (1 + step)/(10 + step)) (a warming decay)."""
    d = min(decay, (1 + step) / (10 + step))
    for e, p in zip(ema, live):
        e.lerp_(p, 1 - d)
