"""Token-level GRPO for token-autoregressive image models (algorithms.md §11: T2I-R1's
BiCoT-GRPO loss, ReasonGen-R1's PPO-clip and group filtering).

Every image token is an action. Per token: ρ = exp(log π_θ − log π_old) with the rollout's own
logit transform (guidance weight, temperature, top-k; `algorithm.train_cfg=false` scores the
conditional policy only, as T2I-R1 trains), the sequence's group advantage A broadcast over its
tokens, PPO-clip max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high)) (ε_high > ε_low: DAPO's clip-higher),
an optional k3 KL to the reference, exp(r − l) − (r − l) − 1 with r, l the reference and
current log-probs, weighted by β, and an entropy term −α·H: α fixed (`entropy_coeff`), or
adaptive towards `entropy_target` (ReasonGen-R1; algorithms/entropy_control.py). The loss is the
token mean over the micro-batch. Advantages: A = (r − mean_g)/(std_g + eps) with the unbiased group
std (torch.std, as both recipes); groups whose rewards are all equal carry no signal and are
dropped (DAPO's filter; `filter_groups`).
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from .advantages import GroupAdvantages, checked_rewards
from .base import Algorithm, register_algorithm
from .entropy_control import AdaptiveEntropyCoefficient


class TokenGRPOSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    clip_range: float = Field(0.2, gt=0, description="PPO ε (ε_low)")
    clip_range_high: float | None = Field(None, gt=0, description="ε_high of DAPO's clip-higher (None: = clip_range)")
    beta: float = Field(0.0, ge=0, description="k3 KL-to-reference weight (T2I-R1: 0.01; ReasonGen-R1: 0)")
    entropy_coeff: float = Field(0.0, description="entropy weight α on the image tokens (the initial α when adaptive)")
    entropy_target: float | None = Field(None, gt=0, description="adaptive α: the image-token entropy (nats) to "
                                                                 "track (ReasonGen-R1: 7.0 for a 16384 codebook)")
    entropy_coeff_lr: float = Field(1e-5, gt=0, description="adaptive α: Adam step size of ψ (α = sinh ψ)")
    entropy_coeff_min: float = Field(-1e-3, description="adaptive α: lower bound (negative: a penalty)")
    entropy_coeff_max: float = Field(1e-3, description="adaptive α: upper bound")
    std_eps: float = Field(1e-4, gt=0, description="A = (r − mean)/(std + eps) (T2I-R1: 1e-4; verl: 1e-6)")
    filter_groups: bool = Field(True, description="drop groups whose rewards are all equal (DAPO)")


def token_group_advantages(rewards: np.ndarray, group_ids: np.ndarray, eps: float) -> GroupAdvantages:
    """A_i = (r_i − mean_g)/(std_g + eps), std_g with ddof 1; a group of one sample gets 0."""
    rewards, group_ids = checked_rewards(rewards, group_ids)
    adv = np.zeros_like(rewards)
    flat = 0
    groups = np.unique(group_ids)
    for g in groups:
        idx = group_ids == g
        r = rewards[idx]
        if len(r) < 2 or np.all(r == r[0]):
            flat += 1
            continue
        adv[idx] = (r - r.mean()) / (r.std(ddof=1) + eps)
    adv = adv.astype(np.float32)
    return GroupAdvantages(advantages=adv, zero_std_ratio=flat / max(1, len(groups)), keep=adv != 0)


def token_ppo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                   clip_low: float, clip_high: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean of max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high)) over [B, N]; A [B] broadcast."""
    adv = advantages.float()[:, None]
    ratio = torch.exp(log_prob - old_log_prob)
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)).mean()
    with torch.no_grad():
        diff = log_prob - old_log_prob
        metrics = {"approx_kl": 0.5 * (diff ** 2).mean(),
                   "clipfrac": ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float().mean(),
                   "ratio_mean": ratio.mean(), "ratio_min": ratio.min(), "ratio_max": ratio.max()}
    return loss, metrics


def k3_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π_θ‖π_ref): exp(r − l) − (r − l) − 1 (≥ 0, unbiased)."""
    d = ref_log_prob - log_prob
    return torch.exp(d) - d - 1


@register_algorithm("token_grpo")
class TokenGRPO(Algorithm):
    Settings = TokenGRPOSettings
    needs = frozenset({"tokens", "log_probs"})

    @property
    def needs_reference(self) -> bool:
        return self.settings.beta > 0

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        return token_group_advantages(rewards, group_ids, self.settings.std_eps)

    def __init__(self, cfg):
        super().__init__(cfg)
        c = self.settings
        self.controller = None
        if c.entropy_target is not None:
            if not c.entropy_coeff_min <= c.entropy_coeff <= c.entropy_coeff_max:
                from ..config.loader import ConfigError

                raise ConfigError(f"algorithm.entropy_coeff={c.entropy_coeff} lies outside [entropy_coeff_min, "
                                  f"entropy_coeff_max] = [{c.entropy_coeff_min}, {c.entropy_coeff_max}]; start α "
                                  f"inside its bounds")
            self.controller = AdaptiveEntropyCoefficient(c.entropy_coeff, c.entropy_target, c.entropy_coeff_lr,
                                                         c.entropy_coeff_min, c.entropy_coeff_max)

    @property
    def entropy_coeff(self) -> float:
        return self.controller.alpha if self.controller else self.settings.entropy_coeff

    def trains_on(self, advantages: np.ndarray) -> np.ndarray:
        return (advantages != 0) | (not self.settings.filter_groups)

    def after_optimizer_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """Adaptive α: one step towards the target from this optimizer step's mean entropy."""
        if self.controller is None:
            return {}
        return {"entropy_coeff": self.controller.update(metrics["entropy"])}

    def state(self) -> dict | None:
        return self.controller.state_dict() if self.controller else None

    def load_state(self, state: dict | None) -> None:
        if self.controller is None:
            return
        c = self.settings
        self.controller = AdaptiveEntropyCoefficient(c.entropy_coeff, c.entropy_target, c.entropy_coeff_lr,
                                                     c.entropy_coeff_min, c.entropy_coeff_max)
        if state is not None:
            self.controller.load_state_dict(state)

    def losses(self, batch, policy):
        """One term per micro-batch: every image token of every sequence in one teacher-forced pass."""
        c = self.settings
        tokens = policy.tensor(batch["tokens"]).long()
        new, entropy = policy.log_probs(tokens)
        old = policy.tensor(batch["log_probs"])
        loss, metrics = token_ppo_loss(new, old, policy.tensor(batch["advantage"]), c.clip_range,
                                       c.clip_range_high if c.clip_range_high is not None else c.clip_range)
        metrics["entropy"] = entropy.detach().mean()
        alpha = self.entropy_coeff
        if alpha != 0:
            loss = loss - alpha * entropy.mean()
        if c.beta > 0:
            with torch.no_grad():
                ref, _ = policy.log_probs(tokens, reference=True)
            kl = k3_kl(new, ref).mean()
            loss = loss + c.beta * kl
            metrics["kl"] = kl.detach()
        yield loss, metrics
