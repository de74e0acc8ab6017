"""V-GRPO — Variational GRPO (Tang et al. 2026, arXiv 2604.23380; docs/algorithms/v_grpo.md):
GRPO with the generation as one action, its log-likelihood an ELBO surrogate — the flow-matching
loss of the final sample — instead of an SDE's per-step log-probs.

Rollouts: the deterministic ODE (DPM-Solver++(2M) or Euler) of the policy; only the final latent
is stored. Advantages: per-prompt GRPO ones (group std by default), clipped at ±adv_clip_max,
then soft-clipped A ← η·tanh(A/η) (Eq. 17).

Update, on `pairs` (N_MC) timestep–noise pairs per update: one grid index from each of `pairs`
equal strata of the rollout grid (the steps the trained weights denoise), drawn from the update's
seed; the noise ε of a pair shared by every sample of a group (drawn from the update's seed, the
group id and the pair), so a group's likelihoods are compared on one basis. Per pair and sample,
with t the grid's σ and x_t = (1 − t)·x0 + t·ε:

    x̂ = x_t − t·v_θ(x_t, t)                        (the x-prediction of the velocity)
    L = mean (x̂ − x0)² / sg(max(mean |x̂ − x0|, 1e-5))   (adaptive weighting, Eq. 14)
    ρ = exp(L_old − L)      J = mean min(ρ·A, clip(ρ, 1 ± ε)·A)  (unclipped when clip_range is None)
    loss = −J + kl_weight · mean (x̂ − x̂_old)²       (Eq. 16's simple KL to θ_old)

θ_old is the rollout's policy: the trained weights themselves, detached, until the update's first
optimizer step (ρ = 1: REINFORCE with a group baseline on −L, the paper's on-policy recipe), the
update's starting weights after it (a frozen copy, with several optimizer steps per iteration).
The conditional velocity is trained (at a guidance-distilled family's rollout scale).
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from ..config.schema import SamplingConfig
from .base import register_algorithm
from .ode_group import ODEGroupAlgorithm, ODEGroupSettings
from .sampling import conditional_scale

PAIR_NOISE, PAIR_LEVELS = 7, 8  # roles of the update seed's draws


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0] >> 1)


class VGRPOSettings(ODEGroupSettings):
    pairs: int = Field(4, ge=1, description="N_MC: timestep–noise pairs per update, one loss term each")
    shared_noise: bool = Field(True, description="one noise per group and pair (the paper's group-shared pairs)")
    soft_clip: float | None = Field(3.0, gt=0, description="η of A ← η·tanh(A/η); None: off")
    clip_range: float | None = Field(None, gt=0, lt=1, description="ε of the ratio's PPO clip; None: unclipped "
                                     "(on-policy, one optimizer step per rollout, ρ = 1 anyway)")
    kl_weight: float = Field(0.0, ge=0, description="weight of mean (x̂_θ − x̂_θold)² (the paper's multi-step "
                             "stages: 0.3)")
    std_eps: float = Field(1e-8, gt=0)
    global_std: bool = Field(False, description="normalise by the batch's reward std instead of each group's")


def adaptive_mse(x_pred: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Per sample: mean (x̂ − x0)² over sg(max(mean |x̂ − x0|, 1e-5)), the weight in float64 (Eq. 14)."""
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        weight = (x_pred.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=1e-5)
    return ((x_pred - x0) ** 2 / weight).mean(dim=dims)


def soft_clipped(adv: torch.Tensor, eta: float | None) -> torch.Tensor:
    return adv if eta is None else eta * torch.tanh(adv / eta)


def stratified_steps(candidates: list[int], pairs: int, seed: int) -> list[int]:
    """One grid index, uniformly, from each of `pairs` strata of `candidates` (in order; the
    strata split at floor(i·n/pairs), so each holds ⌊n/pairs⌋ or ⌈n/pairs⌉ of them)."""
    u = np.random.default_rng(_seed(seed, PAIR_LEVELS)).random(pairs)
    bounds = np.floor(np.linspace(0, len(candidates), pairs + 1)).astype(int)
    pos = bounds[:-1] + np.floor(u * (bounds[1:] - bounds[:-1])).astype(int)
    return [candidates[i] for i in pos]


def group_noise(shape, groups: np.ndarray, seed: int, pair: int) -> torch.Tensor:
    """ε of each row: one float32 draw per group id (CPU generator: the same on every device and rank)."""
    draws = {}
    for g in dict.fromkeys(int(x) for x in groups):
        gen = torch.Generator().manual_seed(_seed(seed, PAIR_NOISE, g, pair))
        draws[g] = torch.randn(tuple(shape), generator=gen, dtype=torch.float32)
    return torch.stack([draws[int(g)] for g in groups])


@register_algorithm("v_grpo")
class VGRPO(ODEGroupAlgorithm):
    Settings = VGRPOSettings
    needs = frozenset({"final_latent"})

    def __init__(self, cfg):
        super().__init__(cfg)
        self._stepped = 0

    @property
    def needs_reference(self) -> bool:
        return False

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        super().check_sampling(sampling, step)
        if sampling.steps < self.settings.pairs:
            raise ValueError(f"algorithm.pairs={self.settings.pairs} strata of a {sampling.steps}-step rollout grid: "
                             f"set algorithm.pairs ≤ sampling.steps")

    def terms(self, batch, trained_steps: frozenset[int] | None = None) -> int:
        return self.settings.pairs if trained_steps is None or trained_steps else 0

    def prepare_update(self, batch) -> dict[str, float]:
        self._stepped = 0
        return {}

    def after_optimizer_step(self, metrics: dict[str, float]) -> dict[str, float]:
        self._stepped += 1
        return {}

    def frozen_slots(self) -> tuple[str, ...]:
        return ("start",) if self.cfg.optimizer_steps_per_iteration > 1 else ()

    def frozen_weights(self, name: str, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return start

    def losses(self, batch, policy):
        c, fam = self.settings, policy.model
        if policy.update_seed is None:
            raise ValueError("algorithm 'v_grpo' draws its timestep–noise pairs from the update's seed "
                             "(ReplayPolicy.update_seed), and this replay has none")
        grid = range(len(policy.timesteps)) if policy.trained_steps is None else sorted(policy.trained_steps)
        if not grid:
            return
        x0 = policy.tensor(batch["final_latent"]).float()
        adv = soft_clipped(policy.tensor(batch["advantage"]).float(), c.soft_clip)
        groups = np.asarray(batch["group_id"])
        old = policy.frozen.get("start") if self._stepped else None
        g = conditional_scale(fam, policy.recipe)
        for j, k in enumerate(stratified_steps(list(grid), c.pairs, policy.update_seed)):
            t, timestep = policy.sigmas[k].float(), policy.timesteps[k].reshape(1).expand(len(x0))
            noise = group_noise(x0.shape[1:], groups, policy.update_seed, j) if c.shared_noise else torch.randn(
                x0.shape, generator=policy.generator, device=policy.generator.device, dtype=torch.float32)
            x_t = (1 - t) * x0 + t * noise.to(x0.device)
            x_pred = x_t - t * fam.velocity(x_t.to(fam.dtype), timestep, policy.cond, g, None).float()
            surrogate = adaptive_mse(x_pred, x0)
            if old is None:
                x_old, old_surrogate = x_pred.detach(), surrogate.detach()
            else:
                with torch.no_grad():
                    x_old = x_t - t * old.velocity(x_t.to(fam.dtype), timestep, policy.cond, g, None).float()
                    old_surrogate = adaptive_mse(x_old, x0)
            ratio = torch.exp(old_surrogate - surrogate)
            objective = ratio * adv
            if c.clip_range is not None:
                objective = torch.minimum(objective, torch.clamp(ratio, 1 - c.clip_range, 1 + c.clip_range) * adv)
            loss = -objective.mean().float()
            r = ratio.detach()
            metrics = {"policy_loss": loss.detach(), "ratio_mean": r.mean(), "ratio_max": r.max(),
                       "ratio_min": r.min(), "vgrpo/surrogate": surrogate.detach().mean(), "vgrpo/t": t,
                       "clipfrac": ((r - 1).abs() > c.clip_range).double().mean() if c.clip_range else r.new_zeros(())}
            if c.kl_weight > 0:
                kl = ((x_pred - x_old) ** 2).mean()
                loss = loss + c.kl_weight * kl
                metrics["kl"] = kl.detach()
            yield loss, metrics
