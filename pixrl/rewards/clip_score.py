"""CLIP score: cosine similarity between the image and its prompt under a CLIP model from a local
directory (reward.options.clip_score.path). The main value is the cosine; `clip_score.clipscore`
is Hessel et al.'s CLIP-S = w · max(cos, 0) with w = 2.5 (arXiv 2104.08718)."""

from __future__ import annotations

import numpy as np

from .base import Reward, register_reward
from .clip_backbone import PixelGradientReward, check_clip_dir


@register_reward("clip_score")
class ClipScore(PixelGradientReward, Reward):
    value_range = (-1.0, 1.0)

    def __init__(self, path: str = "", batch_size: int = 32, w: float = 2.5):
        check_clip_dir(path, "clip_score")
        self.path, self.batch_size, self.w = path, batch_size, w
        self.clip = None

    def setup(self, device: str = "cpu") -> None:
        from .clip_backbone import ClipBackbone

        super().setup(device)
        self.clip = ClipBackbone(self.path, device, self.name)

    def score(self, images, prompts, metadata):
        c = self.clip.cosines(images, prompts, self.batch_size)
        return {self.name: c, f"{self.name}.clipscore": (self.w * np.maximum(c, 0)).astype(np.float32)}
