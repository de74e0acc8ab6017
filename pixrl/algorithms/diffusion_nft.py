"""DiffusionNFT (Zheng et al. 2025; NVlabs/DiffusionNFT; algorithms.md §7): online RL on the
forward process, likelihood-free and solver-agnostic.

Rollouts: a deterministic ODE (DPM-Solver++ 2M, "dpm2") from the *sampling* policy θ_old,
CFG-free; only the final latent x0 is stored. Rewards become optimality probabilities
r = clip((clip(A, ±5)/5)/2 + ½, 0, 1) from Flow-GRPO's per-prompt advantages.

Update, per sample on int(T·train_fraction) timesteps of a shuffled copy of the rollout grid
(a two-expert checkpoint: of the T grid steps its trained expert denoises), with fresh noise ε
and x_t = (1 − t)·x0 + t·ε:

    v⁺ = β·v_θ + (1 − β)·v_old          v⁻ = (1 + β)·v_old − β·v_θ
    x̂0± = x_t − t·v±                    w± = stopgrad(mean_CHW |x̂0± − x0|) ∨ 1e-5   (fp64)
    L   = adv_clip_max · mean_B[(r·mean_CHW (x̂0⁺ − x0)²/w⁺ + (1 − r)·mean_CHW (x̂0⁻ − x0)²/w⁻)/β]
          + kl_weight · mean (v_θ − v_ref)²          (v_ref: the base model)

After each update the sampling policy follows: θ_old ← d·θ_old + (1 − d)·θ, with
d = min(rate·(step − flat), cap) (0 before `flat`), step = the run's optimizer steps so far.
θ_old is the algorithm's state, saved with the optimizer state of every checkpoint; the
published policy is θ. Upstream's separate eval EMA (decay 0.9, every step) is algorithm.ema
(`every=1`), off in the presets.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from ..config.schema import SamplingConfig
from .advantages import GroupAdvantages, group_advantages
from .base import Algorithm, register_algorithm
from .sampling import SamplerRecipe, conditional_scale
from .weight_average import blend, on_host

#: return_decay's (flat, rate, cap) per decay_type (train_nft_sd3.py)
DECAY_TYPES = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}


class DiffusionNFTSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    beta: float = Field(1.0, gt=0, description="NFT's mixing strength β of the implicit policies (config.beta)")
    kl_weight: float = Field(1e-4, ge=0, description="weight of mean (v_θ − v_base)² (config.train.beta)")
    adv_clip_max: float = Field(5.0, gt=0)
    std_eps: float = Field(1e-4, gt=0)
    global_std: bool = True
    train_fraction: float = Field(0.99, gt=0, le=1, description="share of the rollout grid's timesteps trained per sample")
    decay_type: Literal[0, 1, 2] = Field(1, description="the sampling policy's EMA schedule: 0 none (θ_old = θ), "
                                         "1 min(0.001·step, 0.5), 2 0 until step 75 then min(0.0075·(step−75), 0.999)")
    solver: Literal["dpm2", "euler"] = Field("dpm2", description="the rollout's ODE solver")


def optimality(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r = clip((clip(A, ±m)/m)/2 + ½, 0, 1): A = m → 1, A = −m → 0, A = 0 → ½."""
    a = torch.clamp(advantages.float(), -adv_clip_max, adv_clip_max)
    return torch.clamp((a / adv_clip_max) / 2 + 0.5, 0, 1)


def return_decay(step: int, decay_type: int) -> float:
    flat, rate, cap = DECAY_TYPES[decay_type]
    return 0.0 if step < flat else min((step - flat) * rate, cap)


def nft_policy_loss(v: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor,
                    r: torch.Tensor, beta: float, scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The implicit positive/negative velocity loss of one timestep per sample (t: [B])."""
    tb = t.reshape(-1, *([1] * (x0.ndim - 1)))
    dims = tuple(range(1, x0.ndim))
    v_pos = beta * v + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v
    x0_pos, x0_neg = x_t - tb * v_pos, x_t - tb * v_neg
    with torch.no_grad():
        w_pos = (x0_pos.double() - x0.double()).abs().mean(dim=dims).clamp(min=1e-5).float()
        w_neg = (x0_neg.double() - x0.double()).abs().mean(dim=dims).clamp(min=1e-5).float()
    l_pos = ((x0_pos - x0) ** 2).mean(dim=dims) / w_pos
    l_neg = ((x0_neg - x0) ** 2).mean(dim=dims) / w_neg
    loss = scale * ((r * l_pos + (1 - r) * l_neg) / beta).mean()
    with torch.no_grad():
        unweighted = ((r * ((x0_pos - x0) ** 2).mean(dim=dims) + (1 - r) * ((x0_neg - x0) ** 2).mean(dim=dims))).mean()
    return loss, {"policy_loss": loss.detach(), "unweighted_policy_loss": unweighted}


@register_algorithm("diffusion_nft")
class DiffusionNFT(Algorithm):
    Settings = DiffusionNFTSettings
    needs = frozenset({"final_latent"})
    separate_sampler = True
    cfg_free = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.load_state(None)

    @property
    def needs_reference(self) -> bool:
        return self.settings.kl_weight > 0

    def check_sampling(self, sampling: SamplingConfig, step: str) -> None:
        if step != "denoise":
            raise ValueError("algorithm 'diffusion_nft' trains flow-matching (denoise) families")
        if sampling.max_rounds > 1:
            raise ValueError("algorithm 'diffusion_nft' trains every sample (flat groups carry r = ½); set "
                             "sampling.max_rounds=1")

    def rollout_recipe(self, sampling: SamplingConfig, rng: np.random.Generator, step: str,
                       iteration: int) -> SamplerRecipe:
        # CFG-free: guidance 1 on a CFG family (preflight), the embedded scale of a guidance-distilled one
        return SamplerRecipe(sampling.steps, 0.0, "sde", sampling.guidance_scale, (), (), ode_solver=self.settings.solver)

    def advantages(self, rewards: np.ndarray, group_ids: np.ndarray) -> GroupAdvantages:
        c = self.settings
        return group_advantages(rewards, group_ids, c.global_std, c.std_eps, c.adv_clip_max)

    def _count(self, grid: int) -> int:
        return max(1, int(grid * self.settings.train_fraction))

    def terms(self, batch, trained_steps: frozenset[int] | None = None) -> int:
        n = len(batch["timesteps"][0]) if trained_steps is None else len(trained_steps)
        return self._count(n) if n else 0

    def losses(self, batch, policy):
        c = self.settings
        if policy.sampler is None:
            raise ValueError("diffusion_nft's loss needs the sampling policy (ReplayPolicy.sampler)")
        x0 = policy.tensor(batch["final_latent"]).float()
        r = optimality(policy.tensor(batch["advantage"]), c.adv_clip_max)
        b, grid, gen = x0.shape[0], len(policy.timesteps), policy.generator
        # the grid steps the trained weights denoise (all but for a two-expert checkpoint)
        steps = range(grid) if policy.trained_steps is None else sorted(policy.trained_steps)
        if not steps:
            return
        candidates = torch.tensor(list(steps), device=x0.device)
        order = torch.stack([torch.randperm(len(steps), generator=gen, device=gen.device)
                             for _ in range(b)]).to(x0.device)
        for j in range(self._count(len(steps))):
            idx = candidates[order[:, j]]
            t, timestep = policy.sigmas[idx].float(), policy.timesteps[idx]
            noise = torch.randn(x0.shape, generator=gen, device=gen.device, dtype=torch.float32).to(x0.device)
            tb = t.reshape(-1, *([1] * (x0.ndim - 1)))
            x_t = (1 - tb) * x0 + tb * noise
            fam = policy.model
            g = conditional_scale(fam, policy.recipe)
            v_old = policy.sampler.velocity(x_t.to(fam.dtype), timestep, policy.cond, g, None).float()
            v = fam.velocity(x_t.to(fam.dtype), timestep, policy.cond, g, None).float()
            loss, metrics = nft_policy_loss(v, v_old, x_t, x0, t, r, c.beta, c.adv_clip_max)
            with torch.no_grad():
                metrics["old_deviate"] = ((v - v_old) ** 2).mean()
            if c.kl_weight > 0:
                v_ref = policy.reference.velocity(x_t.to(fam.dtype), timestep, policy.cond, g, None).float()
                kl = ((v - v_ref) ** 2).mean()
                loss = loss + c.kl_weight * kl
                metrics["kl"] = kl.detach()
            yield loss, metrics

    # --- the sampling policy θ_old: the algorithm's state ----------------------------------------
    def sampling_weights(self) -> dict[str, torch.Tensor] | None:
        return self._old

    def set_sampling_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self._old = weights

    def end_of_update(self, weights: dict[str, torch.Tensor], optimizer_steps: int) -> dict[str, float]:
        self._step += optimizer_steps
        d = return_decay(self._step, self.settings.decay_type)
        self._old = blend(self._old, weights, d)
        return {"nft/old_decay": d}

    def state(self) -> dict:
        return {"old": on_host(self._old),
                "step": self._step}

    def load_state(self, state: dict | None) -> None:
        if state is None:
            self._old, self._step = None, 0
        else:
            self._old, self._step = state["old"], int(state["step"])
