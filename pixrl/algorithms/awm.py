"""AWM — Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050; docs/algorithms/awm.md):
policy gradient whose log-likelihood is the pretraining loss itself, on the forward process.

Rollouts: the deterministic ODE of the policy (or, `off_policy`, of the EMA anchor), at
sampling.guidance_scale; only the final latent x0 is stored. Advantages: Flow-GRPO's per-prompt
ones, A = clip(A, ±m)/m·advantage_max (m = adv_clip_max).

Update, per micro-batch on `train_timesteps` noise levels t (one per term; AWM's time_type:
strata of the rollout grid's indices up to int(T·timestep_fraction), or stratified draws from a
shifted uniform / logit-normal law), fresh noise ε per sample and x_t = (1 − t)·x0 + t·ε:

    ℓ = mean_CHW (v_θ(x_t, t) − (ε − x0))²                      (float64)
    log p = −w(ℓ, t):  uniform ℓ · t ℓ · t2 t²ℓ · huber t(√(ℓ + 1e-10) − 1e-5)
                       ghuber (t/p)((ℓ + 1e-10)^p − 1e-10^p)
    ρ = exp(log p − log p_old)       L = mean_B max(−A·ρ, −A·clip(ρ, 1 ± clip_range))
          + kl_weight · mean (v_θ − v_base)² + ema_kl_weight · mean (v_θ − v_ema)²

log p_old is the sampling policy's at the same (x_t, t): the trained weights themselves, detached,
until the update's first optimizer step (AWM's on-policy micro-batches: ρ = 1, the gradient
A·∇log p), the update's starting weights after it, the EMA anchor when `off_policy`. The anchor
θ_ema (AWM's "kl_ema" adapter) starts at the first update's weights and follows after each update:
θ_ema ← d·θ_ema + (1 − d)·θ, d = min(ema_kl_decay, 0.001·step) (linear) or ema_kl_decay (constant),
step = the run's optimizer steps so far. It is the algorithm's state, saved with the optimizer
state of every checkpoint; the published policy is θ.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from .base import register_algorithm
from .ode_group import ODEGroupAlgorithm, ODEGroupSettings
from .sampling import model_timesteps
from .weight_average import blend, on_host

TIME_TYPES = ("discrete_wo_init", "discrete", "discrete_with_init", "uniform", "logit_normal")


class AWMSettings(ODEGroupSettings):
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = Field(
        "ghuber", description="w(ℓ, t) of the matching loss that serves as −log p (AWM's config.train.weighting)")
    ghuber_power: float = Field(0.25, gt=0, description="p of the generalised Huber weighting")
    train_timesteps: int = Field(6, ge=1, description="noise levels per micro-batch, one loss term each")
    timestep_fraction: float = Field(0.9, gt=0, le=1, description="discrete time types: the grid indices below "
                                     "int(steps·fraction) are drawn from")
    time_type: Literal[TIME_TYPES] = Field("discrete_wo_init", description="how the noise levels are drawn")
    time_shift: float = Field(3.0, gt=0, description="uniform / logit_normal: t ← s·t/(1 + (s − 1)·t)")
    clip_range: float = Field(1.0, gt=0, description="PPO clip of ρ (AWM's default 1: on-policy, it never bites)")
    advantage_max: float | None = Field(1.0, gt=0, description="the clipped advantage is rescaled to ±this; None: "
                                        "kept as clipped")
    kl_weight: float = Field(0.003, ge=0, description="β of mean (v_θ − v_base)² (AWM's config.train.beta)")
    kl_time_weight: Literal["uniform", "elbo"] = Field("uniform", description="elbo: the KL term over 2σ_t², "
                                                       "σ_t = 0.7·√(t/(1 − min(t, 0.99)))")
    ema_kl_weight: float = Field(1.0, ge=0, description="weight of mean (v_θ − v_ema)² (AWM's ema_beta)")
    ema_kl_decay: float = Field(0.3, ge=0, lt=1, description="the anchor's EMA decay (its cap, when linear)")
    ema_kl_decay_type: Literal["linear", "constant"] = "linear"
    off_policy: bool = Field(False, description="sample with the EMA anchor (AWM's off_policy), and take ρ to it")
    solver: Literal["euler", "dpm2"] = Field("euler", description="the rollout's ODE solver")


def matching_log_prob(v: torch.Tensor, target: torch.Tensor, t: torch.Tensor, weighting: str,
                      power: float = 0.25) -> torch.Tensor:
    """AWM's log p of each sample: −w(ℓ, t), ℓ the per-sample mean squared velocity error (fp64)."""
    err = (v.double() - target.double()) ** 2
    log_p = -err.mean(dim=tuple(range(1, err.ndim)))
    t = t.double().reshape(-1)
    if weighting == "t":
        return log_p * t
    if weighting == "t2":
        return log_p * t ** 2
    if weighting == "huber":
        return -(torch.sqrt(-log_p + 1e-10) - 1e-5) * t
    if weighting == "ghuber":
        eps = torch.tensor(1e-10, dtype=log_p.dtype, device=log_p.device)
        return -(torch.pow(-log_p + eps, power) - torch.pow(eps, power)) * t / power
    return log_p


def clipped_advantages(adv: torch.Tensor, clip: float, scale_to: float | None) -> torch.Tensor:
    a = torch.clamp(adv.float(), -clip, clip)
    return a if scale_to is None else a / clip * scale_to


def ppo_loss(log_p: torch.Tensor, old_log_p: torch.Tensor, adv: torch.Tensor, clip_range: float):
    """mean max(−A·ρ, −A·clip(ρ, 1 ± c)) with ρ = exp(log p − stopgrad log p_old), and ρ."""
    ratio = torch.exp(log_p - old_log_p.detach())
    unclipped = -adv.double() * ratio
    clipped = -adv.double() * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped).mean().float(), ratio.detach()


def ema_decay(step: int, cap: float, kind: str) -> float:
    return cap if kind == "constant" else min(cap, 0.001 * step)


def draw_levels(settings: AWMSettings, grid: int, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, bool]:
    """The update's noise levels of one micro-batch: [terms, batch] grid indices (discrete time
    types, one per term) or noise levels t (continuous ones), and whether they are indices."""
    c, n = settings, settings.train_timesteps
    rand = lambda *shape: torch.rand(shape, generator=gen, device=gen.device).cpu()  # noqa: E731
    if c.time_type.startswith("discrete"):
        top = int(grid * c.timestep_fraction)
        first = 0 if c.time_type == "discrete" else 1
        strata = n if c.time_type != "discrete_with_init" else n - 1
        bounds = torch.linspace(first, top, strata + 1).long()
        lo, hi = bounds[:-1], bounds[1:]
        idx = lo + (rand(strata) * (hi - lo)).long()
        if c.time_type == "discrete_with_init":
            idx = torch.cat([torch.zeros(1, dtype=torch.long), idx])
        return idx.clamp(max=grid - 1)[:, None].expand(n, batch), True
    if c.time_type == "uniform":  # stratified over [0.2, 1], shuffled within each column
        u = 0.2 + (torch.arange(n)[:, None] + rand(n, batch)) / n * 0.8
        t = torch.gather(u, 0, rand(n, batch).argsort(dim=0))
    else:  # logit-normal: stratified normal quantiles, shuffled, one per term
        base = (torch.arange(n) + rand(n)) / n
        z = torch.distributions.Normal(0.0, 1.0).icdf(base.clamp(1e-7, 1 - 1e-7))
        t = torch.sigmoid(z[torch.randperm(n, generator=gen, device=gen.device).cpu()])[:, None].expand(n, batch)
    t = c.time_shift * t / (1 + (c.time_shift - 1) * t)
    return (t.clamp(min=0.01) if c.time_type == "logit_normal" else t), False


def level_sample(policy, levels: torch.Tensor, on_grid: bool, j: int, x0: torch.Tensor):
    """The j-th drawn level's (t [B], model timestep, x_t = (1 − t)·x0 + t·ε, u = ε − x0), ε fresh
    from the update's generator (float32)."""
    if on_grid:
        idx = levels[j].to(policy.sigmas.device)
        t, timestep = policy.sigmas[idx].float(), policy.timesteps[idx]
    else:
        t = levels[j].to(x0.device)
        timestep = model_timesteps(policy.model, t)
    noise = torch.randn(x0.shape, generator=policy.generator, device=policy.generator.device,
                        dtype=torch.float32).to(x0.device)
    tb = t.reshape(-1, *([1] * (x0.ndim - 1)))
    return t, timestep, (1 - tb) * x0 + tb * noise, noise - x0


@register_algorithm("awm")
class AWM(ODEGroupAlgorithm):
    Settings = AWMSettings
    needs = frozenset({"final_latent"})

    def __init__(self, cfg):
        super().__init__(cfg)
        self.separate_sampler = self.settings.off_policy  # the rollouts' policy: the EMA anchor
        self._stepped = 0
        self.load_state(None)

    @property
    def needs_reference(self) -> bool:
        return self.settings.kl_weight > 0

    def _keeps_anchor(self) -> bool:
        return self.settings.off_policy or self.settings.ema_kl_weight > 0

    def terms(self, batch, trained_steps: frozenset[int] | None = None) -> int:
        return self.settings.train_timesteps

    # --- the update ---------------------------------------------------------------------------
    def prepare_update(self, batch) -> dict[str, float]:
        self._stepped = 0
        return {}

    def after_optimizer_step(self, metrics: dict[str, float]) -> dict[str, float]:
        self._stepped += 1
        return {}

    def frozen_slots(self) -> tuple[str, ...]:
        c = self.settings
        slots = () if c.off_policy or self.cfg.optimizer_steps_per_iteration == 1 else ("start",)
        return slots + (("anchor",) if c.ema_kl_weight > 0 and not c.off_policy else ())

    def frozen_weights(self, name: str, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if name == "start":
            return start
        if self._ema is None:
            self._ema = {k: v.detach().clone() for k, v in start.items()}
        return self._ema

    def losses(self, batch, policy):
        c = self.settings
        fam = policy.model
        x0 = policy.tensor(batch["final_latent"]).float()
        adv = clipped_advantages(policy.tensor(batch["advantage"]), c.adv_clip_max, c.advantage_max)
        levels, on_grid = draw_levels(c, len(policy.timesteps), len(x0), policy.generator)
        anchor = policy.sampler if c.off_policy else policy.frozen.get("anchor")
        old = policy.sampler if c.off_policy else (policy.frozen.get("start") if self._stepped else None)
        g, neg = policy.recipe.guidance_scale, policy.neg
        for j in range(c.train_timesteps):
            t, timestep, x_t, target = level_sample(policy, levels, on_grid, j, x0)

            def velocity(model):
                return model.velocity(x_t.to(fam.dtype), timestep, policy.cond, g, neg).float()

            v = velocity(fam)
            log_p = matching_log_prob(v, target, t, c.weighting, c.ghuber_power)
            if old is None:
                old_log_p = log_p.detach()
            else:
                with torch.no_grad():
                    old_log_p = matching_log_prob(velocity(old), target, t, c.weighting, c.ghuber_power)
            loss, ratio = ppo_loss(log_p, old_log_p, adv, c.clip_range)
            metrics = {"policy_loss": loss.detach(), "ratio_mean": ratio.mean(), "ratio_max": ratio.max(),
                       "ratio_min": ratio.min(), "clipfrac": ((ratio - 1).abs() > c.clip_range).double().mean(),
                       "awm/matching_loss": (-log_p.detach()).mean(), "awm/t": t.mean()}
            if c.kl_weight > 0:
                with torch.no_grad():
                    v_ref = velocity(policy.reference)
                kl = self._kl(v, v_ref, t)
                loss = loss + c.kl_weight * kl
                metrics["kl"] = kl.detach()
            if c.ema_kl_weight > 0:
                with torch.no_grad():
                    v_ema = velocity(anchor)
                ema_kl = ((v - v_ema) ** 2).mean()
                loss = loss + c.ema_kl_weight * ema_kl
                metrics["ema_kl"] = ema_kl.detach()
            yield loss, metrics

    def _kl(self, v: torch.Tensor, v_ref: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        per = ((v - v_ref) ** 2).mean(dim=tuple(range(1, v.ndim)))
        if self.settings.kl_time_weight == "elbo":
            std = 0.7 * torch.sqrt(t / (1 - torch.clamp(t, 0, 0.99)))
            per = per / (2 * std ** 2)
        return per.mean()

    # --- the EMA anchor: the algorithm's state -------------------------------------------------
    def sampling_weights(self) -> dict[str, torch.Tensor] | None:
        return self._ema

    def set_sampling_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self._ema = weights

    def end_of_update(self, weights: dict[str, torch.Tensor], optimizer_steps: int) -> dict[str, float]:
        self._step += optimizer_steps
        if not self._keeps_anchor():
            return {}
        d = ema_decay(self._step, self.settings.ema_kl_decay, self.settings.ema_kl_decay_type)
        self._ema = blend(self._ema, weights, d)
        return {"awm/ema_decay": d}

    def state(self) -> dict:
        return {"ema": on_host(self._ema),
                "step": self._step}

    def load_state(self, state: dict | None) -> None:
        if state is None:
            self._ema, self._step = None, 0
        else:
            self._ema, self._step = state["ema"], int(state["step"])
