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

With a chain of thought (sampling.cot_tokens > 0) the text tokens are actions too, as T2I-R1
trains them: the loss and the KL are token means over [text ; image] with the text's own mask
(nothing after its end-of-sentence token), one advantage per sequence; the entropy terms are
separate — α_image·H_image + α_text·H_text, each α fixed or adaptive towards its own target
(ReasonGen-R1: text 2.0, image 7.0 nats). A chain of thought sampled by a text server can be
importance-corrected towards the policy (`rollout_correction`: algorithms/rollout_correction.py).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from .advantages import GroupAdvantages, checked_rewards
from .base import Algorithm, register_algorithm
from .entropy_control import AdaptiveEntropyCoefficient
from .rollout_correction import Mode, rollout_weights


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
    text_entropy_coeff: float = Field(0.0, description="entropy weight on the chain-of-thought tokens (the initial "
                                                       "α_text when adaptive)")
    text_entropy_target: float | None = Field(None, gt=0, description="adaptive α_text: the text-token entropy to track "
                                                                      "(ReasonGen-R1: 2.0); bounds and step as α's")
    std_eps: float = Field(1e-4, gt=0, description="A = (r − mean)/(std + eps) (T2I-R1: 1e-4; verl: 1e-6)")
    filter_groups: bool = Field(True, description="drop groups whose rewards are all equal (DAPO)")
    ratio_to: Literal["rollout", "current"] = Field(
        "rollout", description="ρ against the rollout's stored log-probs (PPO), or against the current policy "
                               "detached — T2I-R1's exp(logp − logp.detach()): 1 in value, gradient A·∇logp, never "
                               "clipped; for one update per rollout, e.g. with train_cfg false")
    rollout_correction: Mode = Field(
        "none", description="importance-correct a chain of thought sampled by a text server (sampling.cot_backend="
                            "vllm) towards the policy: token_truncate (min(ρ, C)), token_mask (drop ρ outside "
                            "[C_low, C]), or the same per sequence")
    rollout_is_threshold: float = Field(2.0, gt=1, description="C: the truncation cap, and the mask's upper bound")
    rollout_is_threshold_low: float | None = Field(None, gt=0, lt=1, description="the mask's lower bound (None: 1/C)")


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


def token_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean over [B, N] (mask None), or over the positions where mask is 1."""
    if mask is None:
        return values.mean()
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1)


def token_ppo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                   clip_low: float, clip_high: float, mask: torch.Tensor | None = None,
                   weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean of w·max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high)) over [B, N] (with `mask`: over its
    1-positions); A [B] broadcast; w: per-token importance weights (rollout correction), else 1."""
    adv = advantages.float()[:, None]
    ratio = torch.exp(log_prob - old_log_prob)
    per_token = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high))
    loss = token_mean(per_token if weights is None else per_token * weights, mask)
    with torch.no_grad():
        diff = log_prob - old_log_prob
        valid = ratio if mask is None else ratio[mask.bool()]
        metrics = {"approx_kl": token_mean(0.5 * diff ** 2, mask),
                   "clipfrac": token_mean(((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float(), mask),
                   "ratio_mean": token_mean(ratio, mask), "ratio_min": valid.min(), "ratio_max": valid.max()}
    return loss, metrics


def k3_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π_θ‖π_ref): exp(r − l) − (r − l) − 1 (≥ 0, unbiased)."""
    d = ref_log_prob - log_prob
    return torch.exp(d) - d - 1


@register_algorithm("token_grpo")
class TokenGRPO(Algorithm):
    Settings = TokenGRPOSettings

    @property
    def needs(self) -> frozenset:
        """The image tokens and their log-probs; with rollout correction, the text server's log-probs too."""
        base = frozenset({"tokens", "log_probs"})
        return base | {"cot_behavior_log_probs"} if self.settings.rollout_correction != "none" else base

    def check_sampling(self, sampling, step: str) -> None:
        if self.settings.rollout_correction != "none" and not (sampling.cot_tokens and sampling.cot_backend == "vllm"):
            raise ValueError(f"algorithm.rollout_correction={self.settings.rollout_correction} corrects a chain of "
                             "thought sampled by a text server: set sampling.cot_tokens > 0 and "
                             "sampling.cot_backend=vllm, or algorithm.rollout_correction=none")

    @property
    def needs_reference(self) -> bool:
        return self.settings.beta > 0

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        return token_group_advantages(rewards, group_ids, self.settings.std_eps)

    def __init__(self, cfg):
        super().__init__(cfg)
        c = self.settings
        for key, value, target in (("entropy_coeff", c.entropy_coeff, c.entropy_target),
                                   ("text_entropy_coeff", c.text_entropy_coeff, c.text_entropy_target)):
            if target is not None and not c.entropy_coeff_min <= value <= c.entropy_coeff_max:
                from ..config.loader import ConfigError

                raise ConfigError(f"algorithm.{key}={value} lies outside [entropy_coeff_min, entropy_coeff_max] = "
                                  f"[{c.entropy_coeff_min}, {c.entropy_coeff_max}]; start it inside its bounds")
        self.load_state(None)

    def _controller(self, initial: float, target: float | None) -> AdaptiveEntropyCoefficient | None:
        c = self.settings
        if target is None:
            return None
        return AdaptiveEntropyCoefficient(initial, target, c.entropy_coeff_lr, c.entropy_coeff_min, c.entropy_coeff_max)

    @property
    def entropy_coeff(self) -> float:
        return self.controller.alpha if self.controller else self.settings.entropy_coeff

    @property
    def text_entropy_coeff(self) -> float:
        return self.text_controller.alpha if self.text_controller else self.settings.text_entropy_coeff

    def trains_on(self, advantages: np.ndarray, group_ids: np.ndarray | None = None) -> np.ndarray:
        return (advantages != 0) | (not self.settings.filter_groups)

    def after_optimizer_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """Adaptive α's: one step each towards its target from this optimizer step's mean entropy."""
        out = {}
        if self.controller is not None:
            out["entropy_coeff"] = self.controller.update(metrics["entropy"])
        if self.text_controller is not None and "entropy_text" in metrics:
            out["text_entropy_coeff"] = self.text_controller.update(metrics["entropy_text"])
        return out

    def state(self) -> dict | None:
        """The image α's state as before; with an adaptive α_text, both under "image"/"text"."""
        if self.text_controller is None:
            return self.controller.state_dict() if self.controller else None
        return {"image": self.controller.state_dict() if self.controller else None,
                "text": self.text_controller.state_dict()}

    def load_state(self, state: dict | None) -> None:
        c = self.settings
        self.controller = self._controller(c.entropy_coeff, c.entropy_target)
        self.text_controller = self._controller(c.text_entropy_coeff, c.text_entropy_target)
        if state is None:
            return
        image, text = (state.get("image"), state.get("text")) if "text" in state else (state, None)
        if self.controller is not None and image is not None:
            self.controller.load_state_dict(image)
        if self.text_controller is not None and text is not None:
            self.text_controller.load_state_dict(text)

    def proximal_columns(self, batch, policy) -> dict[str, np.ndarray]:
        """The stored tokens' log-probs (and the chain of thought's) under `policy`, as `losses`
        scores them; the server's behaviour log-probs stay, so the rollout correction then weighs
        the recomputed policy against the server that sampled."""
        with torch.no_grad():
            out = {"log_probs": policy.log_probs(policy.tensor(batch["tokens"]).long())[0].float().cpu().numpy()}
            if "cot_tokens" in batch:
                cot, mask = policy.tensor(batch["cot_tokens"]).long(), policy.tensor(batch["cot_mask"]).long()
                out["cot_log_probs"] = policy.text_log_probs(cot, mask)[0].float().cpu().numpy()
        return {k: v.astype(np.asarray(batch[k]).dtype) for k, v in out.items()}

    def losses(self, batch, policy):
        """One term per micro-batch: every token of every sequence (the chain of thought's, then
        the image's) in one teacher-forced pass each."""
        c = self.settings
        tokens = policy.tensor(batch["tokens"]).long()
        new, entropy = policy.log_probs(tokens)
        old = policy.tensor(batch["log_probs"])
        mask = text_entropy = weights = None
        correction = {}
        if "cot_tokens" in batch:
            cot, cot_mask = policy.tensor(batch["cot_tokens"]).long(), policy.tensor(batch["cot_mask"]).long()
            new_text, text_entropy = policy.text_log_probs(cot, cot_mask)
            old_text = policy.tensor(batch["cot_log_probs"])
            new, old = torch.cat([new_text, new], 1), torch.cat([old_text, old], 1)
            kept = cot_mask
            if c.rollout_correction != "none":
                w, kept, correction = rollout_weights(old_text, policy.tensor(batch["cot_behavior_log_probs"]), cot_mask,
                                                      c.rollout_correction, c.rollout_is_threshold,
                                                      c.rollout_is_threshold_low)
                weights = torch.cat([w, torch.ones_like(tokens, dtype=w.dtype)], 1)
            mask = torch.cat([kept, torch.ones_like(tokens)], 1)
        if c.ratio_to == "current":
            old = new.detach()
        loss, metrics = token_ppo_loss(new, old, policy.tensor(batch["advantage"]), c.clip_range,
                                       c.clip_range_high if c.clip_range_high is not None else c.clip_range, mask,
                                       weights)
        metrics.update(correction)
        metrics["entropy"] = entropy.detach().mean()
        alpha = self.entropy_coeff
        if alpha != 0:
            loss = loss - alpha * entropy.mean()
        if text_entropy is not None:
            h_text = token_mean(text_entropy, cot_mask)
            metrics["entropy_text"] = h_text.detach()
            metrics["cot_length"] = cot_mask.sum(1).float().mean()
            if self.text_entropy_coeff != 0:
                loss = loss - self.text_entropy_coeff * h_text
        if c.beta > 0:
            with torch.no_grad():
                ref, _ = policy.log_probs(tokens, reference=True)
                if mask is not None:
                    ref = torch.cat([policy.text_log_probs(cot, cot_mask, reference=True)[0], ref], 1)
            kl = token_mean(k3_kl(new, ref), mask)
            loss = loss + c.beta * kl
            metrics["kl"] = kl.detach()
        yield loss, metrics
