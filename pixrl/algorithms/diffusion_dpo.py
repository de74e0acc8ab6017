"""Diffusion-DPO in flow-matching form (Wallace et al. 2023; algorithms.md §9, flow_grpo's
train_sd3_dpo.py for the flow-matching target).

For a pair (x0_w, x0_l) of clean latents of one prompt, one σ and one ε are shared:
x_σ = (1−σ)·x0 + σ·ε, target v = ε − x0, e(x) = mean_CHW ‖v − v_θ(x_σ, σ, c)‖².
inside = −½·β·[(e_θ(w) − e_ref(w)) − (e_θ(l) − e_ref(l))], L = −mean log σ(inside).
At θ = ref, inside = 0 and L = ln 2. implicit_acc = mean(inside > 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TIMESTEP_SCHEMES = ("logit_normal", "uniform")


def sample_sigmas(n: int, scheme: str, generator: torch.Generator, mean: float = 0.0, std: float = 1.0,
                  eps: float = 1e-3) -> torch.Tensor:
    """σ ∈ (0, 1) per pair: sigmoid(N(mean, std)) (SD3's logit-normal) or uniform."""
    if scheme == "logit_normal":
        s = torch.sigmoid(mean + std * torch.randn(n, generator=generator))
    elif scheme == "uniform":
        s = torch.rand(n, generator=generator)
    else:
        raise ValueError(f"unknown timestep scheme {scheme!r}; choose one of {', '.join(TIMESTEP_SCHEMES)}")
    return s.clamp(eps, 1 - eps)


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_σ, v target) for the rectified-flow convention of diffusers' FlowMatchEulerDiscreteScheduler."""
    s = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * noise, noise - x0


def velocity_error(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean over non-batch elements of (v_pred − v)², fp32: [B]."""
    return ((pred.float() - target.float()) ** 2).mean(dim=tuple(range(1, pred.ndim)))


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
