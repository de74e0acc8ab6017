"""Diffusion-DPO in flow-matching form (Wallace et al. 2023; algorithms.md §9, flow_grpo's
train_sd3_dpo.py for the flow-matching target).

For a pair (x0_w, x0_l) of clean latents of one prompt, one σ and one ε are shared (σ drawn
logit-normal, then time-shifted like the model's training schedule, as flow_grpo draws it):
x_σ = (1−σ)·x0 + σ·ε, target v = ε − x0, e(x) = mean_CHW ‖v − v_θ(x_σ, σ, c)‖².
inside = −½·β·[(e_θ(w) − e_ref(w)) − (e_θ(l) − e_ref(l))], L = −mean log σ(inside).
At θ = ref, inside = 0 and L = ln 2. implicit_acc = mean(inside > 0).

A variance-preserving family (SD1.x/2.x) is trained as DiffusionDPO trains it: `timesteps=ddpm`
draws t uniform over its training timesteps, and the error is its own prediction's (ε, or v) —
the velocity error times the family's `prediction_error_weight(σ)`, (1 − σ)² for ε (exact
algebra: at a fixed x_σ, ε − ε̂ = (1 − σ)(v − v̂)).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from .base import Algorithm, register_algorithm
from .ode_solvers import shifted, unshifted
from .sampling import conditional_scale, model_timesteps

TIMESTEP_SCHEMES = ("logit_normal", "uniform", "ddpm")


def sample_sigmas(n: int, scheme: str, generator: torch.Generator, mean: float = 0.0, std: float = 1.0,
                  eps: float = 1e-3, within: tuple[float, float] | None = None) -> torch.Tensor:
    """σ ∈ (0, 1) per pair: sigmoid(N(mean, std)) (SD3's logit-normal) or uniform. `within`: the
    same distribution truncated to [lo, hi] (inverse-CDF draws, one uniform per pair)."""
    if within is not None:
        return _truncated_sigmas(n, scheme, generator, mean, std, eps, within)
    if scheme == "logit_normal":
        s = torch.sigmoid(mean + std * torch.randn(n, generator=generator, device=generator.device))
    elif scheme == "uniform":
        s = torch.rand(n, generator=generator, device=generator.device)
    elif scheme == "ddpm":
        raise ValueError("timesteps=ddpm draws a DDPM family's own training timesteps (draw_noise_levels)")
    else:
        raise ValueError(f"unknown timestep scheme {scheme!r}; choose one of {', '.join(TIMESTEP_SCHEMES)}")
    return s.clamp(eps, 1 - eps)


def _truncated_sigmas(n: int, scheme: str, generator: torch.Generator, mean: float, std: float, eps: float,
                      within: tuple[float, float]) -> torch.Tensor:
    lo, hi = max(within[0], eps), min(within[1], 1 - eps)
    if not lo < hi:
        raise ValueError(f"no σ to draw in [{within[0]}, {within[1]}] within ({eps}, {1 - eps})")
    u = torch.rand(n, generator=generator, device=generator.device, dtype=torch.float64)
    if scheme == "uniform":
        return (lo + (hi - lo) * u).float()
    if scheme != "logit_normal":
        raise ValueError(f"unknown timestep scheme {scheme!r}; choose one of {', '.join(TIMESTEP_SCHEMES)}")
    bounds = torch.tensor([lo, hi], dtype=torch.float64, device=u.device)
    cdf = torch.special.ndtr((torch.logit(bounds) - mean) / std)  # the logit-normal's CDF at lo and hi
    z = torch.special.ndtri(cdf[0] + (cdf[1] - cdf[0]) * u)
    return torch.sigmoid(mean + std * z).clamp(lo, hi).float()


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_σ, v target) for the rectified-flow convention of diffusers' FlowMatchEulerDiscreteScheduler."""
    s = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * noise, noise - x0


def velocity_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean over non-batch elements of (v_pred − v)², fp32: [B]."""
    return ((pred.float() - target.float()) ** 2).mean(dim=tuple(range(1, pred.ndim)))


def prediction_error(model, pred: torch.Tensor, target: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The per-sample error in the family's own parameterisation: the velocity error, weighted by
    `prediction_error_weight(σ)` where the family predicts something else (ε, v of a DDPM model)."""
    err = velocity_error(pred, target)
    weight = getattr(model, "prediction_error_weight", None)
    return err if weight is None else err * weight(sigma).to(err)


def dpo_loss(err_w: torch.Tensor, err_l: torch.Tensor, ref_err_w: torch.Tensor, ref_err_l: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Diffusion-DPO loss over a batch of pairs, with its diagnostics (detached)."""
    inside = -0.5 * beta * ((err_w - ref_err_w) - (err_l - ref_err_l))
    loss = -F.logsigmoid(inside).mean()
    with torch.no_grad():
        metrics = {
            "implicit_acc": (inside > 0).float().mean(),
            "implicit_margin": inside.mean(),  # β-scaled log-likelihood-ratio margin, winner over loser
            "err_w": err_w.mean(), "err_l": err_l.mean(),
            "ref_err_w": ref_err_w.mean(), "ref_err_l": ref_err_l.mean(),
        }
    return loss, metrics


class NoiseLevelSettings(BaseModel):
    """How the offline flow-matching losses draw σ per sample (Diffusion-DPO and SFT on winners)."""

    model_config = ConfigDict(extra="forbid")
    timesteps: Literal["logit_normal", "uniform", "ddpm"] = Field(
        "logit_normal", description="how σ is drawn per pair (ddpm: a DDPM family's training timesteps, uniform)")
    logit_mean: float = Field(0.0, description="mean of the logit-normal σ")
    logit_std: float = Field(1.0, gt=0, description="std of the logit-normal σ")
    shift: float | None = Field(None, gt=0, description="SD3's time shift applied to the drawn σ, as the model's "
                                "training schedule draws it (flow_grpo: shift 3 → σ at the 10/50/90th percentiles "
                                "≈ 0.46/0.75/0.92); None: the model scheduler's shift (`shift`, or `flow_shift` "
                                "for Wan and SANA); 1: unshifted")


class DPOSettings(NoiseLevelSettings):
    """Diffusion-DPO's own keys of the `algorithm` section (where the pairs come from is `dpo`)."""

    beta: float = Field(100.0, gt=0, description="β of the DPO loss (flow_grpo's Flow-DPO uses 100)")


def draw_noise_levels(n: int, settings: NoiseLevelSettings, policy) -> torch.Tensor:
    """σ per sample as the model's training schedule draws it: logit-normal (or uniform), then the
    time shift; on a two-expert checkpoint only where the trained expert denoises (its shifted
    range, drawn unshifted)."""
    if settings.timesteps == "ddpm":
        draw = getattr(policy.model, "training_noise_levels", None)
        if draw is None:
            raise ValueError(f"algorithm.timesteps=ddpm draws a DDPM model's training timesteps; the "
                             f"{policy.model.name} family is flow-matching: choose logit_normal or uniform")
        return draw(n, policy.generator)
    sched = policy.model.scheduler.config
    shift = settings.shift if settings.shift is not None else \
        float(sched.get("shift") or sched.get("flow_shift") or 1.0)
    span = policy.model.trained_sigmas() if hasattr(policy.model, "trained_sigmas") else None
    within = None if span is None else tuple(unshifted(v, shift) for v in span)
    sigma = sample_sigmas(n, settings.timesteps, policy.generator, settings.logit_mean, settings.logit_std,
                          within=within)
    return shifted(sigma, shift) if shift != 1.0 else sigma


@register_algorithm("diffusion_dpo")
class DiffusionDPO(Algorithm):
    """The offline algorithm: a micro-batch is b winners then their b losers (final latents and
    prompts, read by key from the archive); one loss term per optimizer step."""

    Settings = DPOSettings
    needs = frozenset({"final_latent"})
    offline = True

    @property
    def needs_reference(self) -> bool:
        return True

    def losses(self, batch, policy):
        x0 = policy.tensor(batch["final_latent"])
        b = len(x0) // 2
        yield pair_loss(x0[:b], x0[b:], policy.cond, self.settings, policy)


def pair_loss(x_w: torch.Tensor, x_l: torch.Tensor, cond, settings: DPOSettings, policy):
    """Diffusion-DPO's loss on b pairs of clean latents (winners, losers), `cond` rows winners then
    losers: one σ and one ε per pair from the update's generator, errors against the reference."""
    b = len(x_w)
    sigma = draw_noise_levels(b, settings, policy)
    noise = torch.randn((b, *x_w.shape[1:]), generator=policy.generator, device=policy.device)
    xt_w, v_w = noised(x_w, noise, sigma)
    xt_l, v_l = noised(x_l, noise, sigma)
    x, target = torch.cat([xt_w, xt_l]), torch.cat([v_w, v_l])
    sigmas = torch.cat([sigma, sigma])
    t = model_timesteps(policy.model, sigmas)
    g = conditional_scale(policy.model, policy.recipe)  # a distilled family's rollout scale (offline: the archive's)
    with torch.no_grad():
        ref = prediction_error(policy.model, policy.reference.velocity(x, t, cond, g), target, sigmas)
    err = prediction_error(policy.model, policy.model.velocity(x.to(policy.model.dtype), t, cond, g), target, sigmas)
    return dpo_loss(err[:b], err[b:], ref[:b], ref[b:], settings.beta)
