"""Flow-DPPO (Ping et al. 2026; UniRL `flowdppo.py`; algorithms.md §8): GRPO's rollout and
advantages, with a KL-and-advantage mask in place of ratio clipping.

Per trained step, from the rollout's frozen transition means μ_old (stored at generate; pixrl's
replay at unchanged weights is bit-identical to them, which is what UniRL's no-grad anchor
replay before the update provides):

    ρ    = exp(log π_θ − log π_old)
    σ_t  = a·sqrt(σ/(1 − min(σ, σ_max)))·sqrt(−Δ)          (1 without kl_coefficient)
    kl   = mean_CHW (μ_θ − μ_old)² / (2σ_t²)
    drop = kl ≥ τ  and  ((ρ > 1 and A > 0) or (ρ < 1 and A < 0))
    L    = mean_B where(drop, 0, −A·ρ)

so a sample is cut off only when the policy has moved past τ in the direction its advantage
pushes; corrective moves always keep their gradient. No ratio or advantage clipping. Several
updates per rollout are the plan's optimizer steps (algorithm.optimizer_steps_per_iteration,
UniRL's num_updates_per_batch), each against the same frozen μ_old and log π_old.
Rollouts: SDE on `num_sde_steps` distinct steps drawn per iteration from `sde_fraction` of the
grid (AllSDEScheduler), ODE elsewhere; those steps are trained.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from ..config.schema import SamplingConfig
from .advantages import GroupAdvantages, group_advantages
from .base import register_algorithm
from .flow_grpo import FlowGRPO, Transition
from .sampling import SamplerRecipe
from .step_schedules import random_sde_steps


class FlowDPPOSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kl_threshold: float = Field(1e-5, gt=0, description="τ: the mask acts once the step's KL reaches it")
    kl_coefficient: bool = Field(True, description="divide the KL by 2σ_t² (UniRL add_kl_coefficient)")
    sigma_max: float = Field(0.99, gt=0, lt=1, description="σ clamp inside σ_t's sqrt(σ/(1−σ))")
    num_sde_steps: int = Field(3, ge=1, description="stochastic (trained) steps per rollout")
    sde_fraction: tuple[float, float] = Field((0.0, 0.5), description="the part of the grid they are drawn from")
    global_std: bool = Field(True, description="group means, one batch-wide std (adv_use_global_std)")
    std_eps: float = Field(1e-4, gt=0)
    filter_zero_advantage: bool = True


def dppo_mask(kl: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, threshold: float):
    """(keep [B], pos_rm [B], neg_rm [B]) of Flow-DPPO's asymmetric mask."""
    over = ~(kl < threshold)
    pos_rm = over & (ratio > 1) & (adv > 0)
    neg_rm = over & (ratio < 1) & (adv < 0)
    return ~(pos_rm | neg_rm), pos_rm, neg_rm


@register_algorithm("flow_dppo")
class FlowDPPO(FlowGRPO):
    Settings = FlowDPPOSettings
    needs = FlowGRPO.needs | {"means"}

    @property
    def needs_reference(self) -> bool:
        return False

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        if sampling.window_size:
            raise ValueError("algorithm 'flow_dppo' draws its own stochastic steps (algorithm.num_sde_steps, "
                             "algorithm.sde_fraction); unset sampling.window_size")
        if sampling.sde_type == "cps":
            raise ValueError("algorithm 'flow_dppo' measures a Gaussian step's KL; set sampling.sde_type=sde")
        if sampling.noise_level <= 0:
            raise ValueError("algorithm 'flow_dppo' needs stochastic steps: set sampling.noise_level > 0")
        lo, hi = self.settings.sde_fraction
        if not 0 <= lo < hi <= 1:
            raise ValueError(f"algorithm.sde_fraction={self.settings.sde_fraction} must satisfy 0 ≤ lo < hi ≤ 1")
        if int(sampling.steps * hi) >= sampling.steps:
            raise ValueError("algorithm.sde_fraction may not reach the last step (its σ' = 0 transition has no "
                             "Gaussian); lower its upper end")

    def rollout_recipe(self, sampling: SamplingConfig, rng: np.random.Generator, step: str,
                       iteration: int) -> SamplerRecipe:
        c = self.settings
        steps = random_sde_steps(sampling.steps, c.num_sde_steps, c.sde_fraction, rng)
        return SamplerRecipe(sampling.steps, sampling.noise_level, sampling.sde_type, sampling.guidance_scale,
                             steps, steps)

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        c = self.settings
        return group_advantages(rewards, group_ids, c.global_std, c.std_eps, clip=np.inf)

    def sigma_t(self, policy, k: int) -> torch.Tensor:
        """UniRL's _compute_sigma_t: a·sqrt(σ/(1 − min(σ, σ_max)))·sqrt(−Δ) for step k (1 when off)."""
        if not self.settings.kl_coefficient:
            return torch.ones((), device=policy.device)
        sigma, nxt = policy.sigmas[k].float(), policy.sigmas[k + 1].float()
        a = policy.recipe.noise_level
        return torch.sqrt(sigma / (1 - torch.clamp(sigma, max=self.settings.sigma_max))) * a * torch.sqrt(sigma - nxt)

    def step_loss(self, tr: Transition, batch, adv: torch.Tensor, policy):
        c = self.settings
        old = policy.tensor(batch["log_probs"][:, tr.j])
        old_mean = policy.tensor(batch["means"][:, tr.j])
        ratio = torch.exp(tr.new.log_prob - old)
        dims = tuple(range(1, tr.new.mean.ndim))
        kl = ((tr.new.mean - old_mean) ** 2).mean(dim=dims) / (2 * self.sigma_t(policy, tr.k) ** 2)
        a = adv.float() if tr.weight is None else tr.weight.float() * adv.float()  # a positive weight keeps a's sign
        keep, pos_rm, neg_rm = dppo_mask(kl.detach(), ratio.detach(), a, c.kl_threshold)
        loss = torch.where(keep, -a * ratio, torch.zeros_like(ratio)).mean()
        with torch.no_grad():
            metrics = {"approx_kl": 0.5 * ((tr.new.log_prob - old) ** 2).mean(),
                       "ratio_mean": ratio.mean(), "ratio_min": ratio.min(), "ratio_max": ratio.max(),
                       "kl_new_old_mean": kl.mean(), "kl_new_old_max": kl.max(),
                       "kl_mask_fraction": (~(kl < c.kl_threshold)).float().mean(),
                       "pos_rm_fraction": pos_rm.float().mean(), "neg_rm_fraction": neg_rm.float().mean(),
                       "masked_fraction": (~keep).float().mean(), "policy_loss": loss.detach()}
        return loss, metrics
