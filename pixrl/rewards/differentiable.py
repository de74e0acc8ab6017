"""Rewards a loss can differentiate — what the direct reward-gradient algorithms (`draft`, `refl`:
algorithms/draft.py) train on. A differentiable reward gives its own main value from decoded
pixels as tensor operations, so the gradient reaches the pixels (and through the family's decode,
the velocity): `pixel_scores(pixels [B, 3, H, W] in [0, 1], prompts) → [B]`. On an image already
at the model's input size it equals `score()` of that image as uint8 (pixels = uint8 / 255);
elsewhere the resize is torch's antialiased bicubic in place of PIL's (close, not bit-equal).
"""

from __future__ import annotations

import torch


class DifferentiableReward:
    """Mixed into a Reward whose main value can be computed from pixel tensors."""

    def pixel_scores(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        raise NotImplementedError


def differentiable_rewards() -> list[str]:
    """The registered rewards a reward-gradient loss can train on."""
    from .base import REWARDS

    return sorted(n for n in REWARDS.names() if issubclass(REWARDS.get(n), DifferentiableReward))


def resize_crop(pixels: torch.Tensor, short: int, crop_h: int, crop_w: int, round_offsets: bool = False) -> torch.Tensor:
    """Shortest edge to `short` (bicubic, antialiased; the long side int(short·long/short side), as
    transformers and torchvision size it), then a centre crop: offsets ⌊Δ/2⌋ (transformers'
    CLIP processor) or round(Δ/2) (torchvision's CenterCrop: ImageReward's preprocessing)."""
    h, w = pixels.shape[-2:]
    if min(h, w) != short:
        size = (int(short * h / w), short) if w <= h else (short, int(short * w / h))
        pixels = torch.nn.functional.interpolate(pixels, size=size, mode="bicubic", antialias=True, align_corners=False)
    dh, dw = pixels.shape[-2] - crop_h, pixels.shape[-1] - crop_w
    top, left = (int(round(dh / 2.0)), int(round(dw / 2.0))) if round_offsets else (dh // 2, dw // 2)
    return pixels[..., top:top + crop_h, left:left + crop_w]


def normalize(pixels: torch.Tensor, mean, std) -> torch.Tensor:
    """(x − mean) / std per channel of [B, 3, H, W]."""
    m = torch.as_tensor(mean, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
    s = torch.as_tensor(std, dtype=pixels.dtype, device=pixels.device).view(1, 3, 1, 1)
    return (pixels - m) / s
