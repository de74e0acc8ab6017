"""Flow-GRPO (Liu et al. 2025; algorithms.md §2): per-prompt group advantages, PPO-clip on the
per-step SDE log-prob ratio, optional KL to the reference on the step means."""

from __future__ import annotations

import numpy as np
import torch

from .advantages import GroupAdvantages, group_advantages
from .base import Algorithm, register_algorithm
from .flow_sde import StepOut, kl_to_reference
from .losses import ppo_clip_loss


@register_algorithm("flow_grpo")
class FlowGRPO(Algorithm):
    needs = frozenset({"latents", "next_latents", "log_probs"})

    @property
    def needs_reference(self) -> bool:
        return self.cfg.beta > 0

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        c = self.cfg
        return group_advantages(rewards, group_ids, c.global_std, c.std_eps, c.adv_clip_max)

    def transition_loss(self, new: StepOut, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                        reference: StepOut | None = None):
        c = self.cfg
        loss, metrics = ppo_clip_loss(new.log_prob, old_log_prob, advantages, c.clip_range, c.adv_clip_max)
        if c.beta > 0:
            if reference is None:
                raise ValueError("flow_grpo with beta > 0 needs the reference step")
            kl = kl_to_reference(new.mean, reference.mean, new.std_dev_t).mean()
            loss = loss + c.beta * kl
            metrics["kl"] = kl.detach()
        return loss, metrics
