"""Higher-order ODE steps for flow matching: multistep DPM-Solver++(2M) on data predictions.

Used where a rollout's steps are deterministic and carry no log-prob: MixGRPO-Flash's steps
after the SDE window (algorithms.md §5.3) and DiffusionNFT's "dpm2" rollouts (§7.1). With
α = 1 − σ, λ = log(α/σ), the data prediction x̂0 = x − σ·v and h = λ_t − λ_s0:

  first order (the first step, and the last one, down to σ = 0):
      x_t = (σ_t/σ_s)·x − α_t(e^{−h} − 1)·x̂0            (= the Euler step x + (σ_t − σ_s)·v)
  second order (midpoint), with the previous step's x̂0 at σ_s1:
      r0 = (λ_s0 − λ_s1)/h,  D1 = (x̂0_s0 − x̂0_s1)/r0
      x_t = (σ_t/σ_s0)·x − α_t(e^{−h} − 1)·(x̂0_s0 + ½·D1)

The first-order step is computed in its Euler form, which is exact at σ_s = 1 (α_s = 0, λ = −∞)
and at σ_t = 0; equal to diffusers' DPMSolverMultistepScheduler (dpmsolver++, order 2,
midpoint, flow sigmas) on the same inputs (tests/test_seed_algorithms.py).
"""

from __future__ import annotations

import math

import torch


def _lam(sigma: float) -> float:
    """λ = log(α/σ) (−∞ at σ = 1, +∞ at σ = 0)."""
    if sigma >= 1.0:
        return -math.inf
    if sigma <= 0.0:
        return math.inf
    return math.log(1.0 - sigma) - math.log(sigma)


def dpm_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float,
             prev_x0: torch.Tensor | None = None, prev_sigma: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One DPM-Solver++(2M) step σ → σ_next from the velocity `v` at x; second order when the
    previous step's data prediction (prev_x0 at prev_sigma) is given and σ_next > 0. Returns
    (x at σ_next, this step's x̂0 — the next step's history). fp32 throughout."""
    x, v = x.float(), v.float()
    x0 = x - sigma * v
    if sigma_next == sigma:  # a zero-length step (Cosmos-Predict2's last, at σ_min) moves nothing
        return x, x0
    if prev_x0 is None or sigma_next <= 0.0 or prev_sigma is None or prev_sigma >= 1.0:
        return x + (sigma_next - sigma) * v, x0  # first order (DDIM, η = 0); at σ_next = 0 this is x̂0
    h = _lam(sigma_next) - _lam(sigma)
    r0 = (_lam(sigma) - _lam(prev_sigma)) / h
    d1 = (x0 - prev_x0.float()) / r0
    alpha_next = 1.0 - sigma_next
    phi = math.expm1(-h)  # e^{−h} − 1
    return (sigma_next / sigma) * x - alpha_next * phi * (x0 + 0.5 * d1), x0


def shifted(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's time shift σ = s·t / (1 + (s − 1)·t)."""
    return shift * t / (1 + (shift - 1) * t)


def unshifted(sigma: float, shift: float) -> float:
    """The t whose shifted value is σ (the inverse of `shifted`)."""
    return sigma / (shift - (shift - 1) * sigma)


def compressed_tail(sigmas: torch.Tensor, last_sde: int, ratio: float, shift: float) -> torch.Tensor:
    """MixGRPO-Flash's schedule after the last SDE step (index `last_sde`): the T − last_sde
    remaining grid points re-spaced onto max(int((T − last_sde)·ratio), 2) points, uniform in
    unshifted time from the point after the window down to the grid's end (0; Cosmos-Predict2's
    σ_min) and shifted again. The first point is the original σ[last_sde + 1] itself, the last
    the grid's own. Upstream allows a single point, which ends sampling at σ > 0 (a noisy image);
    pixrl keeps at least one step to the grid's end."""
    total = len(sigmas) - 1  # T steps
    n = max(int((total - last_sde) * ratio), 2)
    start, end = float(sigmas[last_sde + 1]), float(sigmas[-1])
    t = torch.linspace(unshifted(start, shift), unshifted(end, shift), n, dtype=torch.float64)
    tail = shifted(t, shift).to(torch.float32)
    tail[0] = sigmas[last_sde + 1]
    tail[-1] = sigmas[-1]
    return tail.to(sigmas.device)
