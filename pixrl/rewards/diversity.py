"""How unlike the rest of its group an image is: GARDO's diversity score (He et al., arXiv
2512.24138; `tinnerhrhe/GARDO`, flow_grpo/stat_tracking.py `PerPromptStatTracker.update`,
type='gardo'), stored as a reward so that the rows keep it and an algorithm can shape advantages
with it (`algorithm=gardo`, `algorithm.diversity=diversity`).

Each image is embedded by a self-supervised vision model (GARDO: DINOv3 ViT-L/16 through timm;
here any DINOv2 / DINOv3 ViT checkpoint in the transformers layout — its CLS token after the last
norm, `pooler_output`, what timm's head-less forward returns — or a CLIP checkpoint's image tower),
the embeddings are L2-normalised, and

    d_i = min_{j ≠ i in i's group} (1 − cos(f_i, f_j))

the distance to the nearest other image of the same prompt: a near-copy of another sample scores
about 0, an image unlike all the others scores high. A group of one has no other image: a
ScoringError naming it (sampling.group_size ≥ 2). Give it weight 0 in reward.weights when only the
algorithm should read it (it stays out of the total then, and is still stored).
"""

from __future__ import annotations

import numpy as np

from .base import ScoringError, register_reward
from .vision_features import ImageFeatureReward


def nearest_distances(features: np.ndarray, groups: list[str]) -> np.ndarray:
    """d_i = min over i's group's others of 1 − cos(f_i, f_j) (features L2-normalised here)."""
    f = np.asarray(features, np.float64)
    f = f / np.linalg.norm(f, axis=1, keepdims=True)
    out = np.empty(len(f))
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    for idx in members.values():
        if len(idx) < 2:
            raise ScoringError(f"reward diversity: sample {idx[0]} is alone in its group, with no other image to "
                               "differ from; it needs sampling.group_size ≥ 2 and whole groups in every scored batch")
        dist = 1.0 - np.clip(f[idx] @ f[idx].T, -1.0, 1.0)
        np.fill_diagonal(dist, np.inf)
        out[idx] = dist.min(axis=1)
    return out


@register_reward("diversity")
class Diversity(ImageFeatureReward):
    groupwise = True
    value_range = (0.0, 2.0)

    def score(self, images, prompts, metadata, groups=None):
        groups = list(groups) if groups is not None else [f"prompt:{p}" for p in prompts]
        feats = np.concatenate([self.embed(images[s:s + self.batch_size]).cpu().numpy()
                                for s in range(0, len(images), self.batch_size)])
        return {self.name: nearest_distances(feats, groups).astype(np.float32)}
