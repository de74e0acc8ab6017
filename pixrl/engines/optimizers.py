"""The update's optimizer (`algorithm.optimizer`) and its learning-rate schedule.

- `adamw`: torch's AdamW (lr, adam_betas, adam_eps, weight_decay): what every seed trains with.
- `adafactor`: transformers' Adafactor as DiffusionDPO trains SDXL (its train.py forces it for
  SDXL; algorithms.md §9.2): the given lr (relative_step and scale_parameter off), weight_decay,
  update clipping at RMS 1.0, no first moment. A matrix's second moment is kept as row and column
  statistics, so its state is rows + columns numbers instead of AdamW's two full copies of the
  weights (a full fine-tune of SDXL's 2.6B UNet: about 10 MB of state against 21 GB in fp32).

The schedule is diffusers'/transformers' `constant_with_warmup` (DiffusionDPO's launchers: 500
warmup steps for SD1.5, 200 for SDXL): the optimizer step numbered s from 0 over the whole run
uses lr·s/W while s < W, then lr. The run's step count travels in the saved optimizer state, so
a resumed or replayed update continues the schedule where it stopped.
"""

from __future__ import annotations

import torch

from ..errors import ExpectedError

OPTIMIZER_NAME = "pixrl_optimizer"  # keys of pixrl's own entries in the saved optimizer state
OPTIMIZER_STEPS = "pixrl_optimizer_steps"


class OptimizerMismatch(ExpectedError, ValueError):
    """A checkpoint's optimizer state was written by another optimizer than the configured one."""


def build_optimizer(params: list[torch.nn.Parameter], algorithm) -> torch.optim.Optimizer:
    """The configured optimizer over `params`, with this run's settings."""
    if algorithm.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=algorithm.lr, weight_decay=algorithm.weight_decay, clip_threshold=1.0,
                         scale_parameter=False, relative_step=False, warmup_init=False)
    return torch.optim.AdamW(params, lr=algorithm.lr, betas=tuple(algorithm.adam_betas), eps=algorithm.adam_eps,
                             weight_decay=algorithm.weight_decay)


def apply_settings(optimizer: torch.optim.Optimizer, algorithm) -> None:
    """This run's settings on every parameter group: `load_state_dict` restores the saved ones
    with the moments, and a resumed run may change the learning rate or weight decay."""
    for group in optimizer.param_groups:
        group.update(lr=algorithm.lr, weight_decay=algorithm.weight_decay)
        if algorithm.optimizer == "adamw":
            group.update(betas=tuple(algorithm.adam_betas), eps=algorithm.adam_eps)


def learning_rate(algorithm, step: int) -> float:
    """The learning rate of the run's optimizer step `step` (from 0): constant after a linear warmup."""
    warmup = algorithm.lr_warmup_steps
    return algorithm.lr * (step / warmup if step < warmup else 1.0)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def split_saved_state(state: dict, algorithm) -> tuple[dict, int]:
    """(the torch optimizer state, the run's optimizer steps before it) from a saved state; a
    state of another optimizer is refused by name before anything is loaded. States written
    before these keys existed are AdamW's, with the step count of their first parameter."""
    state = dict(state)
    name = state.pop(OPTIMIZER_NAME, "adamw")
    steps = state.pop(OPTIMIZER_STEPS, None)
    if name != algorithm.optimizer:
        raise OptimizerMismatch(f"the checkpoint's optimizer state is {name}'s, but algorithm.optimizer="
                                f"{algorithm.optimizer}; continue it with algorithm.optimizer={name}, or start a new "
                                f"run (a new run name) to train with {algorithm.optimizer}")
    if steps is None:
        first = next(iter(state.get("state", {}).values()), {})
        steps = int(first.get("step", 0))
    return state, int(steps)


def saved_state(state: dict, algorithm, steps: int) -> dict:
    """The optimizer's state_dict with the optimizer's name and the run's step count beside it."""
    return {**state, OPTIMIZER_NAME: algorithm.optimizer, OPTIMIZER_STEPS: int(steps)}
