"""GARDO (He et al., arXiv 2512.24138; `tinnerhrhe/GARDO`, scripts/train_sd3_grpo_gardo.py and
flow_grpo/stat_tracking.py): Flow-GRPO that resists reward hacking without giving up exploration,
by three changes to where and how it regularises.

1. **Gated KL.** The KL to the reference (Flow-GRPO's, on the step means) applies only to the
   iteration's samples whose proxy reward is least corroborated by auxiliary rewards. Each score
   ranks the iteration's samples (rank 1 the highest; ties in sample order), and
       u_i = rank_proxy(i) − mean_k rank_k(i)
   over the auxiliary scores k (GARDO: aesthetic and ImageReward beside OCR / GenEval / HPS).
   Of the samples with u ≥ 0 the top fraction φ is gated (u above the (1 − φ) percentile of
   those, numpy's linear interpolation). φ adapts (GARDO's `RiskCompensator`): starting at 0.1,
   ×1.1 when this iteration's mean non-negative u exceeds every one of the last 20 iterations',
   ×0.9 when it is below all of them, kept in [0.02, 0.2]. The sign follows the released
   scripts: a positive u is a sample the proxy ranks *below* the auxiliary models.
   Loss = mean_B PPO-clip + β · mean over the micro-batch's gated samples of
   mean_CHW (μθ − μref)²/(2 s_t²) (no KL term when none is gated).
2. **Adaptive reference.** When an optimizer step's mean KL (its loss terms', 0 where none is
   gated) exceeds `kl_threshold`, or `reset_every` updates have passed since the last reset, the
   reference becomes the current policy for the next iteration (GARDO copies the trained
   adapter into its "old" one). The reference's weights are the algorithm's state, saved with
   every checkpoint, so resume and replay use the same reference.
3. **Diversity-aware advantages.** A = (r − mean_group) · w without dividing by the std (GARDO
   drops it: a group's tiny score gaps stay tiny), with w_i = d_i / mean_group(d) where
   r_i ≥ mean_group and 1 below it; d_i is each image's distance to the nearest other image of
   its group (the `diversity` reward, DINO features). `divide_by_std` restores Flow-GRPO's
   normalisation; without `diversity`, w = 1.

Deviations: GARDO weighs each sample's PPO term by s_t / mean_B(s_t), which is 1 here (a
micro-batch's samples share their step); a group whose images are all identical (mean d = 0)
keeps w = 1 where GARDO's division gives NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config.schema import SamplingConfig
from .advantages import GroupAdvantages, checked_rewards, stored_scores
from .base import register_algorithm
from .flow_grpo import FlowGRPO, Transition
from .flow_sde import kl_to_reference
from .losses import ppo_clip_loss


class GARDOSettings(BaseModel):
    """GARDO's keys of the `algorithm` section (defaults: its config/gardo.py on SD3.5-M)."""

    model_config = ConfigDict(extra="forbid")
    proxy: str | None = Field(None, description="the stored score the advantages maximise (a reward or a "
                              "component, e.g. ocr); None: the weighted total `reward`")
    auxiliary: list[str] = Field(default_factory=list, description="stored scores that corroborate the proxy "
                                 "(GARDO: aesthetic, imagereward); the KL gate ranks against them")
    diversity: str | None = Field(None, description="the stored score of each image's distance to its group "
                                  "(reward `diversity`); None: no diversity shaping")
    beta: float = Field(0.04, ge=0, description="KL weight on the gated samples")
    kl_threshold: float = Field(3e-4, gt=0, description="an optimizer step's mean KL above this resets the reference")
    reset_every: int = Field(15, ge=1, description="reset the reference after this many updates without one")
    gate_start: float = Field(0.1, gt=0, le=1, description="the gated fraction φ at the start")
    gate_min: float = Field(0.02, gt=0, le=1)
    gate_max: float = Field(0.2, gt=0, le=1)
    gate_rate: float = Field(0.1, ge=0, lt=1, description="φ's relative step up or down")
    gate_window: int = Field(20, ge=1, description="iterations the controller compares against")
    clip_range: float = Field(1e-4, gt=0)
    adv_clip_max: float = Field(5.0, gt=0)
    divide_by_std: bool = Field(False, description="Flow-GRPO's std normalisation (GARDO removes it)")
    global_std: bool = True
    std_eps: float = Field(1e-4, gt=0)
    filter_zero_advantage: bool = True

    @model_validator(mode="after")
    def _gate_bounds(self):
        if not self.gate_min <= self.gate_start <= self.gate_max:
            raise ValueError(f"gate_min ≤ gate_start ≤ gate_max, got {self.gate_min}, {self.gate_start}, "
                             f"{self.gate_max}")
        if self.beta > 0 and not self.auxiliary:
            raise ValueError("the KL gate ranks the proxy against auxiliary scores: name them in algorithm.auxiliary "
                             "(e.g. [aesthetic, imagereward], also in reward.weights), or set algorithm.beta=0")
        return self


# --- advantages ---------------------------------------------------------------------------------
def diversity_weights(centred: np.ndarray, distances: np.ndarray) -> np.ndarray:
    """One group's w: d / mean(d) where r − mean ≥ 0, else 1 (all 1 if mean(d) = 0)."""
    mean_d = float(np.mean(distances))
    if mean_d == 0:
        return np.ones_like(centred)
    return np.where(centred < 0, 1.0, np.asarray(distances, np.float64) / mean_d)


def gardo_advantages(rewards, group_ids, distances=None, divide_by_std: bool = False, global_std: bool = True,
                     eps: float = 1e-4, clip: float = 5.0) -> GroupAdvantages:
    """A = (r − mean_group) · w (÷ (std + eps) with divide_by_std), clipped to ±clip."""
    rewards, group_ids = checked_rewards(rewards, group_ids)
    adv = np.zeros_like(rewards)
    batch_std = float(np.std(rewards))
    flat = 0
    groups = np.unique(group_ids)
    for g in groups:
        idx = group_ids == g
        r = rewards[idx]
        flat += np.std(r) == 0
        centred = r - r.mean()
        a = centred if distances is None else centred * diversity_weights(centred, np.asarray(distances)[idx])
        if divide_by_std:
            a = a / ((batch_std if global_std else float(np.std(r))) + eps)
        adv[idx] = a
    adv = np.clip(adv, -clip, clip).astype(np.float32)
    return GroupAdvantages(advantages=adv, zero_std_ratio=flat / max(1, len(groups)), keep=adv != 0)


# --- the KL gate --------------------------------------------------------------------------------
def descending_ranks(scores: np.ndarray) -> np.ndarray:
    """Rank 1 for the highest score, N for the lowest; equal scores in sample order."""
    order = np.argsort(-np.asarray(scores, np.float64), kind="stable")
    ranks = np.empty(len(order), np.float64)
    ranks[order] = np.arange(1, len(order) + 1)
    return ranks


def uncertainty(proxy: np.ndarray, auxiliary: list[np.ndarray]) -> np.ndarray:
    """u = rank_proxy − mean_k rank_k over the batch (positive: the proxy ranks the sample lower)."""
    return descending_ranks(proxy) - np.mean([descending_ranks(a) for a in auxiliary], axis=0)


def gate(u: np.ndarray, fraction: float) -> np.ndarray:
    """The samples whose u is above the (1 − fraction) percentile of the non-negative u's."""
    nonneg = u[u >= 0]
    if not len(nonneg):
        return np.zeros(len(u), bool)
    return u > np.percentile(nonneg, 100 - fraction * 100)


@dataclass
class GateController:
    """GARDO's RiskCompensator: the gated fraction follows the risk (mean non-negative u)."""

    start: float
    low: float
    high: float
    rate: float
    window: int
    fraction: float | None = None
    risks: list[float] = field(default_factory=list)

    def update(self, u: np.ndarray) -> float:
        nonneg = u[u >= 0]
        risk = float(np.mean(nonneg)) if len(nonneg) else 0.0
        if not self.risks:
            f = self.start
        elif risk > max(self.risks):
            f = self.fraction * (1 + self.rate)
        elif risk < min(self.risks):
            f = self.fraction * (1 - self.rate)
        else:
            f = self.fraction
        self.fraction = float(np.clip(f, self.low, self.high))
        self.risks = (self.risks + [risk])[-self.window:]
        return self.fraction


@register_algorithm("gardo")
class GARDO(FlowGRPO):
    Settings = GARDOSettings
    needs = FlowGRPO.needs | {"reward", "rewards"}
    reference_in_state = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self._gated: dict[str, bool] = {}
        self.load_state(None)

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        if sampling.noise_level <= 0 and self.settings.beta > 0:
            raise ValueError("algorithm 'gardo' gates a KL between stochastic steps: set sampling.noise_level > 0")

    def advantage_scores(self) -> list[str]:
        """The stored scores `advantages` reads beside the total (the stage passes them as `scores`)."""
        c = self.settings
        return [n for n in (c.proxy, c.diversity) if n is not None]

    def scores_read(self) -> list[str]:
        """Every stored score GARDO reads (preflight checks the rewards store them)."""
        return list(dict.fromkeys([*self.advantage_scores(), *self.settings.auxiliary]))

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray, scores: dict | None = None) -> GroupAdvantages:
        c, scores = self.settings, scores or {}
        proxy = scores[c.proxy] if c.proxy is not None else rewards
        distances = scores[c.diversity] if c.diversity is not None else None
        return gardo_advantages(proxy, group_ids, distances, c.divide_by_std, c.global_std, c.std_eps,
                                c.adv_clip_max)

    # --- the update ---------------------------------------------------------------------------
    @property
    def needs_reference(self) -> bool:
        return self.settings.beta > 0

    def reference_weights(self) -> dict[str, torch.Tensor] | None:
        """The reference's trainable weights (None: the base model's, until the first reset)."""
        return self._reference

    def prepare_update(self, batch) -> dict[str, float]:
        """Gate the iteration's samples (every row of the update's batch) once per update."""
        c = self.settings
        if c.beta <= 0:
            return {}
        scores = stored_scores(batch["rewards"], [n for n in (c.proxy, *c.auxiliary) if n is not None],
                               list(batch["sample_id"]))  # the rows' stored scores, read once
        proxy = scores[c.proxy] if c.proxy is not None else np.asarray(batch["reward"], np.float64)
        u = uncertainty(proxy, [scores[a] for a in c.auxiliary])
        fraction = self._controller.update(u)
        gated = gate(u, fraction)
        self._gated = dict(zip(batch["sample_id"], gated.tolist()))
        return {"gardo/gate_fraction": fraction, "gardo/gated": float(gated.sum()),
                "gardo/risk": self._controller.risks[-1]}

    def step_loss(self, tr: Transition, batch, adv: torch.Tensor, policy):
        c = self.settings
        loss, metrics = ppo_clip_loss(tr.new.log_prob, policy.tensor(batch["log_probs"][:, tr.j]), adv,
                                      c.clip_range, c.adv_clip_max, tr.weight)
        metrics["policy_loss"] = loss.detach()
        if c.beta > 0:
            rows = [i for i, sid in enumerate(batch["sample_id"]) if self._gated.get(sid, False)]
            kl = torch.zeros((), device=loss.device)
            if rows:
                with torch.no_grad():
                    ref = policy.step(tr.x, tr.x_next, tr.k, reference=True)
                kl = kl_to_reference(tr.new.mean[rows], ref.mean[rows], tr.new.std_dev_t[rows]).mean()
                loss = loss + c.beta * kl
            metrics["kl"] = kl.detach()
        return loss, metrics

    def after_optimizer_step(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.settings.beta > 0 and metrics.get("kl", 0.0) > self.settings.kl_threshold:
            self._pending = True
        return {}

    def end_of_update(self, weights: dict[str, torch.Tensor], optimizer_steps: int) -> dict[str, float]:
        """Reset the reference to these weights (the next iteration's policy) when due."""
        self._updates += 1
        reset = self.settings.beta > 0 and (self._pending or self._updates - self._last_reset > self.settings.reset_every)
        if reset:
            self._reference = {k: v.detach().clone() for k, v in weights.items()}
            self._last_reset, self._pending = self._updates, False
        return {"gardo/reference_reset": float(reset), "gardo/reference_age": float(self._updates - self._last_reset)}

    def state(self) -> dict:
        ctl = self._controller
        return {"reference": self._reference, "pending": self._pending, "last_reset": self._last_reset,
                "updates": self._updates, "gate_fraction": ctl.fraction, "risks": list(ctl.risks)}

    def load_state(self, state: dict | None) -> None:
        c = self.settings
        self._controller = GateController(c.gate_start, c.gate_min, c.gate_max, c.gate_rate, c.gate_window)
        state = state or {}
        self._reference = state.get("reference")
        self._pending = bool(state.get("pending", False))
        self._last_reset, self._updates = int(state.get("last_reset", 0)), int(state.get("updates", 0))
        self._controller.fraction = state.get("gate_fraction")
        self._controller.risks = list(state.get("risks", []))
