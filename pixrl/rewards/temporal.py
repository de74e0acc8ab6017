"""Temporal consistency of a clip: 1 − the mean absolute change between consecutive frames
(pixels in [0, 1]), so a still clip scores 1 and flicker or jumps lower it. A clip reward: it
sees the whole clip; pair it with a frame-wise reward (which alone would be maximised by a
frozen clip) through reward.weights."""

from __future__ import annotations

import numpy as np

from .base import Reward, ScoringError, register_reward


@register_reward("temporal_consistency")
class TemporalConsistency(Reward):
    value_range = (0.0, 1.0)
    takes = "clip"

    def score(self, images, prompts, metadata):
        if images.ndim != 5 or images.shape[1] < 2:
            raise ScoringError(f"temporal_consistency scores clips of ≥ 2 frames [B, F, H, W, 3]; got {images.shape}")
        steps = np.abs(np.diff(images.astype(np.float32) / 255.0, axis=1)).mean(axis=(2, 3, 4))  # [B, F−1]
        return {self.name: (1.0 - steps.mean(axis=1)).astype(np.float32),
                f"{self.name}.max_step": steps.max(axis=1).astype(np.float32)}
