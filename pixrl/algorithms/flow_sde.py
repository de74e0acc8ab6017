"""One stochastic flow-matching step with its log-probability (Flow-GRPO §2.1, CPS §2.2,
DanceGRPO §4.1, DDPO's DDIM-η §10).

Convention (diffusers FlowMatchEulerDiscreteScheduler): x_σ = (1−σ)x0 + σε, σ runs 1 → 0,
v ≈ ε − x0, Δ = σ' − σ < 0. All math is fp32 ("bf16 can overflow here"). Log-probs are the
mean over latent elements, which is why clip ranges are ~1e-4.

Rollout calls `flow_step(..., prev_sample=None)` and draws x'; replay calls the same function
with the stored x' — same code, same dtype → ratio exactly 1 with unchanged weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

SdeType = Literal["sde", "cps", "dance", "ddim"]
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOut:
    prev_sample: torch.Tensor  # x' [B, ...]
    log_prob: torch.Tensor  # [B], mean over non-batch elements
    mean: torch.Tensor  # μ [B, ...]
    std: torch.Tensor  # [B], the std of x' given x (0 for a deterministic step)
    std_dev_t: torch.Tensor  # [B], flow_grpo's returned coefficient: s_t (SDE) or the std (CPS)
    velocity: torch.Tensor | None = None  # v (fp32) the step was taken with


def _bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def _mean_chw(t: torch.Tensor) -> torch.Tensor:
    return t.mean(dim=tuple(range(1, t.ndim)))


def vp_norm(sigma: torch.Tensor) -> torch.Tensor:
    """n(σ) = sqrt((1 − σ)² + σ²): a flow latent x = (1 − σ)x0 + σε is n(σ) times the
    variance-preserving latent √ᾱ·x0 + √(1 − ᾱ)·ε of the same noise level, with
    √ᾱ = (1 − σ)/n and √(1 − ᾱ) = σ/n (models/sd15.py maps a DDPM schedule onto σ this way: `sigma_of_alpha_bar`)."""
    return torch.sqrt((1 - sigma) ** 2 + sigma**2)


def ddim_moments(x: torch.Tensor, v: torch.Tensor, s: torch.Tensor, sn: torch.Tensor,
                 eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DDPO's DDIM-η transition (algorithms.md §10) in the variance-preserving coordinates:
    (μ, σ_t) of x'_vp given x_vp = x/n(σ), with x̂0 = x − σv and ε̂ = x + (1 − σ)v (the velocity's
    data and noise predictions, which an ε- or v-predicting model's are, exactly):
    σ_t = η·sqrt((1 − ᾱ')/(1 − ᾱ)·(1 − ᾱ/ᾱ')), μ = √ᾱ'·x̂0 + sqrt(1 − ᾱ' − σ_t²)·ε̂."""
    n, n_next = vp_norm(s), vp_norm(sn)
    alpha_bar, alpha_bar_next = ((1 - s) / n) ** 2, ((1 - sn) / n_next) ** 2
    one_minus, one_minus_next = (s / n) ** 2, (sn / n_next) ** 2  # 1 − ᾱ, without the cancellation
    variance = one_minus_next / one_minus * (1 - alpha_bar / alpha_bar_next)
    std = eta * torch.sqrt(torch.clamp(variance, min=0.0))
    mean = torch.sqrt(alpha_bar_next) * (x - s * v) + torch.sqrt(
        torch.clamp(one_minus_next - std**2, min=0.0)) * (x + (1 - s) * v)
    return mean, std


def sigma_tilde(s: torch.Tensor, sigma_max: float) -> torch.Tensor:
    """σ̃ in s_t = a·sqrt(σ/(1 − σ̃)): σ above sigmas[1] (`sigma_max`) — the first step — takes
    sigmas[1]. flow_grpo replaces σ = 1 exactly; "σ > sigmas[1]" also covers grids that start just
    below 1 (Wan's shipped UniPC grid at 1 − 1e-6, SANA's DPM-Solver one at 1 − 3e-4), where
    1/(1 − σ) blew the first step's std up to hundreds (docs/runs/family_learning_wan). On a grid
    from 1 the two rules agree bit for bit: every later σ is ≤ sigmas[1]."""
    return torch.minimum(s, torch.full_like(s, sigma_max))


def flow_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    sigma_max: float,
    noise_level: float,
    sde_type: SdeType = "sde",
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> StepOut:
    """x_σ → x_σ' with log π(x'|x).

    sigma, sigma_next: [B] (or scalars). sigma_max: sigmas[1] of the schedule, in place of the
    first step's σ (1, or just below it: `sigma_tilde`) so the SDE std stays finite. noise: ε for
    rollout (required when prev_sample is None and the step is stochastic). Gradient flows only through the mean (x' is detached).
    """
    v = velocity.float()
    x = sample.float()
    b = x.shape[0]
    sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(b) if torch.as_tensor(
        sigma).ndim == 0 else sigma.float()
    sigma_next = torch.as_tensor(sigma_next, dtype=torch.float32, device=x.device).expand(b) if torch.as_tensor(
        sigma_next).ndim == 0 else sigma_next.float()
    s, sn = _bcast(sigma, x), _bcast(sigma_next, x)
    mean, std, coef = _moments(sde_type, x, v, s, sn, sigma_max, noise_level)
    if prev_sample is None:
        if noise_level == 0:
            prev_sample = mean
        else:
            if noise is None:
                raise ValueError("a stochastic step needs `noise` (ε) when prev_sample is not given")
            prev_sample = mean + std * noise.float()
    x_next = prev_sample.detach().float()
    if sde_type in ("sde", "dance"):
        log_prob = _gaussian_log_prob(x_next, mean, std)
    elif sde_type == "ddim":  # DDPO's log π of x'_vp = x'/n(σ'): the flow latent's density times n(σ')
        log_prob = _gaussian_log_prob(x_next, mean, std) + torch.log(vp_norm(sn))
    else:  # CPS: constants removed, unnormalised (as in flow_grpo)
        log_prob = -((x_next - mean) ** 2)
    log_prob = _mean_chw(log_prob)
    return StepOut(prev_sample=prev_sample, log_prob=log_prob, mean=mean,
                   std=std.reshape(b, -1)[:, 0], std_dev_t=coef.reshape(b, -1)[:, 0], velocity=v)


def _moments(sde_type: str, x, v, s, sn, sigma_max: float, noise_level: float):
    """(μ, std, flow_grpo's returned coefficient) of x' given x for each kernel."""
    dt = sn - s
    if sde_type == "sde":
        sig_tilde = sigma_tilde(s, sigma_max)
        s_t = noise_level * torch.sqrt(s / (1.0 - sig_tilde))
        mean = x * (1 + s_t**2 / (2 * s) * dt) + v * (1 + s_t**2 * (1 - s) / (2 * s)) * dt
        return mean, s_t * torch.sqrt(-dt), s_t
    if sde_type == "dance":  # DanceGRPO (algorithms.md §4.1): the same drift with s_t ≡ η
        mean = x + dt * (v + noise_level**2 / (2 * s) * (x + (1 - s) * v))
        return mean, noise_level * torch.sqrt(-dt), torch.full_like(s, noise_level)
    if sde_type == "cps":
        std = sn * math.sin(noise_level * math.pi / 2)
        x0_hat, x1_hat = x - s * v, x + (1 - s) * v
        mean = (1 - sn) * x0_hat + torch.sqrt(torch.clamp(sn**2 - std**2, min=0.0)) * x1_hat
        return mean, std, std
    if sde_type == "ddim":  # the moments of x'_vp, carried to the flow coordinates x' = n(σ')·x'_vp
        mean_vp, std_vp = ddim_moments(x, v, s, sn, noise_level)
        n_next = vp_norm(sn)
        return mean_vp * n_next, std_vp * n_next, std_vp * n_next
    raise ValueError(f"unknown sde_type {sde_type!r}; choose 'sde', 'cps', 'dance' or 'ddim'")


def _gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    safe = torch.clamp(std, min=torch.finfo(torch.float32).tiny)
    return -((x - mean) ** 2) / (2 * safe**2) - torch.log(safe) - _LOG_SQRT_2PI


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std_dev_t: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's KL as implemented: mean_CHW (μθ − μref)² / (2 s_t²) per sample, with s_t the
    step's `std_dev_t`. The paper divides by 2·s_t²·|Δ|; flow_grpo omits |Δ| (its issue #78),
    and so do we, so β values carry over from its configs."""
    s2 = _bcast(std_dev_t.float(), mean) ** 2
    return _mean_chw((mean - ref_mean) ** 2 / (2 * torch.clamp(s2, min=1e-20)))
