"""Image-to-video by a clean first latent frame (Wan2.2-TI2V-5B, LTX-Video): the pipelines keep
the source's latents as the clip's first latent frame — given to the transformer at timestep 0,
its output there discarded — and step only the rest. pixrl's sampler steps the whole latent; the
first frame's velocity is then the exact flow velocity towards the known clean frame, (x − c)/σ:
Euler lands on c at σ = 0, and that part of every transition holds no policy parameter (its
log-prob terms are equal under any weights, and DPO's and DiffusionNFT's targets there are met).
A stochastic last step would leave that frame at c plus its noise; the pipelines overwrite it with
c at the end, and so does the family's `final_latents` (the sampler's last act)."""

from __future__ import annotations

import torch

__all__ = ["held_final", "held_input", "held_timesteps", "held_velocity"]


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


def held_timesteps(family, x: torch.Tensor, timestep: torch.Tensor, cond, guidance_scale: float, neg,
                   per_frame: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's timestep [B], each token's [B, F'·per_frame] with the first latent frame's at 0),
    after the checks every held-frame velocity makes (a condition encoded, a negative for CFG)."""
    from .source_images import SourceImageError

    if cond.condition is None:
        raise SourceImageError(f"the {family.name} family animates a first frame: these prompts were encoded without "
                               "source images")
    if guidance_scale > 1.0 and neg is None:
        raise ValueError("guidance_scale > 1 needs the negative-prompt conditioning")
    b, f = x.shape[0], x.shape[2]
    t = timestep.reshape(-1).to(x.device)
    t = t.expand(b) if t.numel() == 1 else t
    tokens = t[:, None].expand(b, f * per_frame).clone()
    tokens[:, :per_frame] = 0  # the condition frame's tokens are clean
    return t, tokens


def held_final(x: torch.Tensor, cond) -> torch.Tensor:
    """The sampled latents [B, C, F', H', W'] with the first latent frame set to each row's
    condition, as the pipelines leave it (exact after a deterministic last step, which lands there;
    the velocity has refused conditioning without one)."""
    return held_input(x, cond.condition)
