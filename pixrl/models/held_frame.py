"""Image-to-video by a clean first latent frame (Wan2.2-TI2V-5B, LTX-Video): the pipelines keep
the source's latents as the clip's first latent frame — given to the transformer at timestep 0,
its output there discarded — and step only the rest. pixrl's sampler steps the whole latent; the
first frame's velocity is then the exact flow velocity towards the known clean frame, (x − c)/σ:
Euler lands on c at σ = 0, and that part of every transition holds no policy parameter (its
log-prob terms are equal under any weights, and DPO's and DiffusionNFT's targets there are met)."""

from __future__ import annotations

import torch

__all__ = ["held_input", "held_velocity"]


def held_input(x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    """Latents [B, C, F', H', W'] with the first latent frame replaced by the condition [B, C, 1, H', W']:
    what the transformer reads (the pipelines' (1 − mask)·c + mask·x)."""
    return torch.cat([condition.to(x.device, x.dtype), x[:, :, 1:]], dim=2)


def held_velocity(x: torch.Tensor, condition: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The transformer's velocity `v` on every latent frame but the first, whose velocity is
    (x − c)/σ towards the condition c (`sigma`: each row's noise level)."""
    s = sigma.reshape(-1, 1, 1, 1, 1).to(x.device, x.dtype)
    toward = (x[:, :, :1] - condition.to(x.device, x.dtype)) / s
    return torch.cat([toward, v[:, :, 1:].to(x.dtype)], dim=2)
