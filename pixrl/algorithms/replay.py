"""What an algorithm's loss sees of the policy: the shared replay step on stored transitions
(denoise) or the teacher-forced scoring of stored tokens (token families), with the iteration's
conditioning and sampler recipe bound, for the trained model and (when the algorithm asks) the
reference. Same function, dtype and micro-batch geometry as the rollout, so the ratio before
any update is exactly 1."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .flow_sde import StepOut
from .sampling import SamplerRecipe, replay_step
from .token_sampling import TokenRecipe, sequence_log_probs, text_log_probs


@dataclass
class ReplayPolicy:
    model: object  # a velocity model on its device (the family, trained weights)
    reference: object | None  # the reference's velocity model, when the algorithm needs it
    cond: object  # the micro-batch's conditioning, one row per batch row
    neg: object | None
    sigmas: torch.Tensor | None  # the rollout's schedule (online algorithms)
    timesteps: torch.Tensor | None
    recipe: SamplerRecipe | None
    device: torch.device
    generator: torch.Generator | None = None  # the update's own randomness (e.g. DPO's σ and ε)
    sampler: object | None = None  # the algorithm's separate sampling policy (DiffusionNFT's "old")
    trained_steps: frozenset[int] | None = None  # grid steps the trained weights denoise; None: every one
    memory: dict[int, torch.Tensor] | None = None  # step k → the guider's stored m_{k−1} (guidance_memory)
    frozen: dict[str, object] = field(default_factory=dict)  # the algorithm's frozen policies (frozen_slots)
    update_seed: int | None = None  # the update's seed: randomness shared by all its micro-batches (V-GRPO's pairs)

    def tensor(self, values: np.ndarray) -> torch.Tensor:
        """A stored array (host) as a tensor on the model's device."""
        return torch.from_numpy(np.array(values, dtype=values.dtype, order="C")).to(self.device)

    def step(self, x: torch.Tensor, x_next: torch.Tensor, k: int, reference: bool = False,
             under: str | None = None) -> StepOut:
        """log π(x_next | x) at step k under the trained model (or the reference, or the frozen
        policy `under` names: DiffusionOPD's teacher)."""
        model = self.frozen.get(under) if under else self.reference if reference else self.model
        if model is None:
            raise ValueError(f"the {under or 'reference'} step was asked for, but the algorithm declared no "
                             f"{under or 'reference'}")
        memory = None if self.memory is None else self.memory[k]
        return replay_step(model, x, x_next, k, self.sigmas, self.timesteps, self.cond, self.neg, self.recipe, memory)


def policy_rows(policy: ReplayPolicy, rows: list[int]) -> ReplayPolicy:
    """The replay policy of some rows of its micro-batch (their conditioning and guider memory):
    to step those rows alone, e.g. under the frozen policy they are routed to (multi-teacher OPD)."""
    memory = None if policy.memory is None else {k: m[rows] for k, m in policy.memory.items()}
    return replace(policy, cond=policy.cond.select(rows), neg=None if policy.neg is None else policy.neg.select(rows),
                   memory=memory)


def trained_grid_steps(model, timesteps: torch.Tensor | None) -> frozenset[int] | None:
    """The steps of a rollout grid whose velocity the trained weights compute — a two-expert
    checkpoint's trained expert's side (`trains_timesteps`); None: every step (one model). An
    algorithm trains, and counts, only these: a step of frozen weights has no gradient."""
    judge = getattr(model, "trains_timesteps", None)
    mask = None if judge is None or timesteps is None else judge(timesteps)
    return None if mask is None else frozenset(i for i, m in enumerate(mask.reshape(-1).tolist()) if m)


@dataclass
class TokenReplayPolicy:
    """What a token algorithm's loss sees: the micro-batch's prompts and the rollout's logit
    transform bound to the trained family (and the reference), scoring stored token sequences
    with the function that produced their stored log-probs."""

    model: object  # a token family (trained weights)
    reference: object | None  # the reference's view, when the algorithm needs it
    cond: object  # the micro-batch's image prompts, one row per batch row
    recipe: TokenRecipe
    device: torch.device
    text_cond: object | None = None  # the reasoning prompts of a chain of thought

    def text_log_probs(self, cot_tokens: torch.Tensor, cot_mask: torch.Tensor,
                       reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(log π(text) [B, C], entropy [B, C]) of the stored chains of thought, 0 where masked."""
        model = self.reference if reference else self.model
        if model is None or self.text_cond is None:
            raise ValueError("text log-probs need the reasoning prompts (and, for the reference, a reference)")
        return text_log_probs(model, self.text_cond, cot_tokens, cot_mask, self.recipe.cot_temperature)

    def tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(values, dtype=values.dtype, order="C")).to(self.device)

    def log_probs(self, tokens: torch.Tensor, reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(log π(tokens) [B, N], entropy of π [B, N]) under the trained model (or the reference)."""
        model = self.reference if reference else self.model
        if model is None:
            raise ValueError("the reference log-probs were asked for, but the algorithm declared no reference")
        return sequence_log_probs(model, self.cond, tokens, self.recipe)
