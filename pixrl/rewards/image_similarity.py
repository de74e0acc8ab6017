"""Image similarity to the source: how much of an editing prompt's source image the edit keeps —
flow_grpo's `image_similarity` reward for FLUX.1 Kontext and Qwen-Image-Edit (rewards.py
`image_similarity_score`: ClipScorer.image_similarity, weighted beside GenEval in its
counting_flux_kontext and counting_qwenimage_edit recipes): the cosine between the CLIP image
embeddings of the edited image and of its source, under a CLIP model from a local directory
(reward.options.image_similarity.path). A DINOv2 / DINOv3 directory there compares their DINO
features instead (visual-rl's DINO similarity: subject identity more than semantics).

The source image arrives in the sample's metadata (`source_image`, its encoded bytes: the
trajectory rows' column); a sample without one is a ScoringError naming it, never a zero."""

from __future__ import annotations

import numpy as np

from ..models.source_images import decode_rgb
from .base import ScoringError, register_reward
from .vision_features import ImageFeatureReward


@register_reward("image_similarity")
class ImageSimilarity(ImageFeatureReward):
    value_range = (-1.0, 1.0)

    def check_prompts(self, prompts: list[str], metadata: list[dict]) -> None:
        check_sources(metadata, self.name)

    def score(self, images, prompts, metadata):
        sources = source_arrays(metadata, self.name)
        out = []
        for s in range(0, len(images), self.batch_size):
            edited = self.embed(images[s:s + self.batch_size])
            source = self.embed(sources[s:s + self.batch_size])
            out.append((edited * source).sum(-1).cpu().numpy())
        return {self.name: np.concatenate(out).astype(np.float32)}


def check_sources(metadata: list[dict], reward: str) -> None:
    """Preflight: every prompt of the set carries a source image (its metadata's `source_image`)."""
    lacking = sum(not m.get("source_image") for m in metadata)
    if lacking:
        raise ValueError(f"reward {reward} compares each edit with its source image, and {lacking} of the "
                         f"{len(metadata)} prompts carry none; train on an editing dataset whose rows carry an "
                         "`image` (docs/editing.md), or remove the reward")


def source_arrays(metadata: list[dict], reward: str) -> list[np.ndarray]:
    """Each sample's source image as uint8 [H, W, 3] (its own size: the CLIP processor resizes)."""
    missing = [i for i, m in enumerate(metadata) if not m.get("source_image")]
    if missing:
        raise ScoringError(f"reward {reward} compares an edit with its source image, and samples {missing[:3]} carry "
                           f"none (metadata 'source_image'); train on an editing dataset (docs/editing.md)")
    return [np.asarray(decode_rgb(m["source_image"]), np.uint8) for m in metadata]
