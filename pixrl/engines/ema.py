"""The moving average of the trainable weights (`algorithm.ema`), as flow_grpo keeps it for
evaluation and saving (`flow_grpo/ema.py`, `scripts/train_sd3.py`; algorithms.md §2.6).

It counts the run's optimizer steps, not an update's: the count travels with the average in every
checkpoint (checkpoints.EMA), so a resumed run, a replayed update and a run trained in one piece
average the same weights at the same steps. The average is held in float32 whatever the weights'
dtype (bf16 weights averaged in bf16 lose the (1 − d)·Δ of small steps); under FSDP each rank
averages its own shards, elementwise, and `state` gathers them whole.
"""

from __future__ import annotations

import torch

from ..config.schema import EmaConfig
from .fsdp import full, like


def ema_decay(step: int, decay: float) -> float:
    """The decay after the run's optimizer step `step` (1-based): min((1 + n)/(10 + n), decay) — a
    warm-up that weighs the newest weights more while the average is young."""
    return min((1 + step) / (10 + step), decay)


def ema_due(step: int, every: int) -> bool:
    """Whether the average moves after optimizer step `step` (flow_grpo: (global_step + 1) % interval)."""
    return (step + 1) % every == 0


class WeightAverage:
    """The average of named trainable tensors, and how many optimizer steps of the run it has seen."""

    def __init__(self, settings: EmaConfig, shadow: dict[str, torch.Tensor], steps: int):
        self.settings, self.shadow, self.steps = settings, shadow, int(steps)

    @classmethod
    def starting_at(cls, settings: EmaConfig, params: dict[str, torch.Tensor], steps: int = 0) -> "WeightAverage":
        """An average that begins at these weights (a run's first update: its starting weights)."""
        return cls(settings, {k: p.detach().to(torch.float32, copy=True) for k, p in params.items()}, steps)

    @classmethod
    def loaded(cls, settings: EmaConfig, weights: dict[str, torch.Tensor], steps: int,
               params: dict[str, torch.Tensor]) -> "WeightAverage":
        """A saved average (whole tensors) laid out like `params` (a sharded rank keeps its shards)."""
        missing = set(params) - set(weights)
        if missing:
            raise ValueError(f"the checkpoint's weight average lacks {len(missing)} trainable tensors, e.g. "
                             f"{sorted(missing)[:3]}; it was written for another model or LoRA setting")
        return cls(settings, {k: like(weights[k], p, torch.float32) for k, p in params.items()}, steps)

    @torch.no_grad()
    def after_optimizer_step(self, params: dict[str, torch.Tensor], micro_batches: int = 1) -> bool:
        """Count the step just taken and, when due, move the average towards `params`:
        ema ← ema + (1 − d)(θ − ema); with `per_micro_batch`, as flow_grpo's k calls with the
        same θ do, ema ← ema + (1 − d^k)(θ − ema), k the step's micro-batches. Returns whether it moved."""
        self.steps += 1
        if not ema_due(self.steps, self.settings.every):
            return False
        decay = ema_decay(self.steps, self.settings.decay)
        rate = 1.0 - decay ** (micro_batches if self.settings.per_micro_batch else 1)
        for k, p in params.items():
            avg = self.shadow[k]
            avg.add_(rate * (p.detach().to(avg.dtype) - avg))
        return True

    def state(self) -> dict[str, torch.Tensor]:
        """The average whole, in float32 (under FSDP a collective: every rank calls it)."""
        return {k: full(v) for k, v in self.shadow.items()}
