"""The shapes-world judge as a reward: λ·correct + (1−λ)·partial credit, with both parts logged."""

from __future__ import annotations

import numpy as np

from ..datasets.shapes.judge import judge
from .base import Reward, ScoringError, register_reward


@register_reward("shapes")
class ShapesJudge(Reward):
    value_range = (0.0, 1.0)

    def __init__(self, correct_weight: float = 0.5):
        if not 0.0 <= correct_weight <= 1.0:
            raise ValueError(f"shapes.correct_weight must be in [0, 1], got {correct_weight}")
        self.correct_weight = correct_weight

    def score(self, images, prompts, metadata):
        correct, partial = [], []
        for i, (img, meta) in enumerate(zip(images, metadata)):
            if not meta or "objects" not in meta:
                raise ScoringError(f"sample {i} (prompt {prompts[i]!r}) has no shapes metadata; the shapes "
                                   f"reward needs prompts from the shapes template language")
            r = judge(img, meta)
            correct.append(r["correct"])
            partial.append(r["partial"])
        c, p = np.array(correct, np.float32), np.array(partial, np.float32)
        return {self.name: self.correct_weight * c + (1 - self.correct_weight) * p,
                f"{self.name}.correct": c, f"{self.name}.partial": p}
