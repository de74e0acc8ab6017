"""Flow-GRPO (Liu et al. 2025; algorithms.md §2): per-prompt group advantages, PPO-clip on the
per-step SDE log-prob ratio, optional KL to the reference on the step means."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from .advantages import GroupAdvantages, group_advantages
from .base import Algorithm, register_algorithm
from .flow_sde import StepOut, kl_to_reference
from .losses import ppo_clip_loss


@dataclass
class Transition:
    """One stored transition of a micro-batch: its position j, step k, x_k, x_{k+1}, and the
    trained policy's step on it (log-prob, mean, std)."""

    j: int
    k: int
    x: torch.Tensor
    x_next: torch.Tensor
    new: StepOut
    weight: torch.Tensor | None = None  # [B] the behaviour weight (run.staleness_weight_cap), else None


class FlowGRPOSettings(BaseModel):
    """Flow-GRPO's own keys of the `algorithm` section (algorithms.md §2.5–2.7)."""

    model_config = ConfigDict(extra="forbid")
    clip_range: float = Field(1e-4, gt=0)
    adv_clip_max: float = Field(5.0, gt=0)
    std_eps: float = Field(1e-4, gt=0)
    global_std: bool = True
    filter_zero_advantage: bool = True
    beta: float = Field(0.0, ge=0, description="KL-to-reference weight")
    shared_noise: bool = Field(False, description="init_same_noise: one initial latent per group (UniRL's recipes)")


@register_algorithm("flow_grpo")
class FlowGRPO(Algorithm):
    Settings = FlowGRPOSettings
    needs = frozenset({"stored_steps", "latents", "next_latents", "log_probs"})
    behaviour_weighted = True

    @property
    def needs_reference(self) -> bool:
        return self.settings.beta > 0

    def rollout_recipe(self, sampling, rng, step: str, iteration: int):
        """The sampling config's recipe; with `shared_noise` a group's members start from one latent."""
        recipe = super().rollout_recipe(sampling, rng, step, iteration)
        if step == "denoise" and getattr(self.settings, "shared_noise", False):
            return replace(recipe, shared_noise=True)
        return recipe

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        c = self.settings
        return group_advantages(rewards, group_ids, c.global_std, c.std_eps, c.adv_clip_max)

    def trains_on(self, advantages: np.ndarray, group_ids: np.ndarray | None = None) -> np.ndarray:
        """Zero-advantage samples carry no gradient (filter_zero_advantage drops them)."""
        return (advantages != 0) | (not self.settings.filter_zero_advantage)

    @staticmethod
    def trainable(batch, trained_steps: frozenset[int] | None) -> list[int]:
        """The stored transitions (positions in `stored_steps`; −1 pads a short window) whose step
        the trained weights denoise, in order."""
        return [j for j, k in enumerate(batch["stored_steps"][0])
                if k >= 0 and (trained_steps is None or int(k) in trained_steps)]

    def terms(self, batch, trained_steps: frozenset[int] | None = None) -> int:
        return len(self.trainable(batch, trained_steps))

    def trained_positions(self, batch, policy) -> list[int]:
        """Which stored transitions the micro-batch trains, in order."""
        return self.trainable(batch, policy.trained_steps)

    def losses(self, batch, policy):
        """One loss term per trained SDE transition of the micro-batch."""
        adv = policy.tensor(batch["advantage"])
        steps = batch["stored_steps"][0]
        for j in self.trained_positions(batch, policy):
            k = int(steps[j])
            x, x_next = policy.tensor(batch["latents"][:, j]), policy.tensor(batch["next_latents"][:, j])
            weight = self.behaviour_weight(batch, j, policy)
            yield self.step_loss(Transition(j, k, x, x_next, policy.step(x, x_next, k), weight), batch, adv, policy)

    def proximal_columns(self, batch, policy) -> dict[str, np.ndarray]:
        """The log-probs (and means, where stored) of every trainable stored transition under
        `policy`, computed as `losses` computes them, so the first optimizer step's ratio is 1."""
        steps = batch["stored_steps"][0]
        out = {name: np.array(batch[name], copy=True) for name in ("log_probs", "means") if name in batch}
        with torch.no_grad():
            for j in self.trainable(batch, policy.trained_steps):
                x, x_next = policy.tensor(batch["latents"][:, j]), policy.tensor(batch["next_latents"][:, j])
                step = policy.step(x, x_next, int(steps[j]))
                out["log_probs"][:, j] = step.log_prob.float().cpu().numpy()
                if "means" in out:
                    out["means"][:, j] = step.mean.float().cpu().numpy()
        return out

    def behaviour_weight(self, batch, j: int, policy) -> torch.Tensor | None:
        """[B] the rows' behaviour weights of stored transition j (run.staleness_weight_cap), else None."""
        if self._behaviour_weights is None:
            return None
        return policy.tensor(np.array([self._behaviour_weights[sid][j] if sid in self._behaviour_weights else 1.0
                                       for sid in batch["sample_id"]], dtype=np.float32))

    def step_loss(self, tr: "Transition", batch, adv: torch.Tensor, policy):
        """PPO-clip (+KL) of one transition, against its stored rollout log-prob."""
        ref = None
        if self.needs_reference:
            with torch.no_grad():
                ref = policy.step(tr.x, tr.x_next, tr.k, reference=True)
        return self.transition_loss(tr.new, policy.tensor(batch["log_probs"][:, tr.j]), adv, ref, tr.weight)

    @staticmethod
    def reference_kl(tr: Transition, policy, std: torch.Tensor) -> torch.Tensor:
        """mean (μθ − μref)² / (2·std²) of the transition against the reference's step on it, with
        `std` flow_grpo's s_t (std_dev_t) or the step's own std (TempFlow-GRPO's)."""
        with torch.no_grad():
            ref = policy.step(tr.x, tr.x_next, tr.k, reference=True)
        return kl_to_reference(tr.new.mean, ref.mean, std).mean()

    def transition_loss(self, new: StepOut, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                        reference: StepOut | None = None, weight: torch.Tensor | None = None):
        c = self.settings
        loss, metrics = ppo_clip_loss(new.log_prob, old_log_prob, advantages, c.clip_range, c.adv_clip_max, weight)
        if c.beta > 0:
            if reference is None:
                raise ValueError("flow_grpo with beta > 0 needs the reference step")
            kl = kl_to_reference(new.mean, reference.mean, new.std_dev_t).mean()
            loss = loss + c.beta * kl
            metrics["kl"] = kl.detach()
        return loss, metrics
