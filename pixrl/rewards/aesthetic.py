"""The LAION aesthetic predictor (improved-aesthetic-predictor, "sac+logos+ava1-l14-linearMSE"):
an MLP on the L2-normalised CLIP ViT-L/14 image embedding, predicting a 1–10 rating; DDPO's
aesthetic reward. Loads the CLIP tower from a local transformers directory
(reward.options.aesthetic.path) and the head from its released state dict
(reward.options.aesthetic.head: the .pth with keys layers.{0,2,4,6,7}.{weight,bias})."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .base import Reward, ScoringError, register_reward
from .clip_backbone import check_clip_dir
from .differentiable import DifferentiableReward


def aesthetic_head(embed_dim: int) -> torch.nn.Sequential:
    """The predictor's MLP, layer for layer, so the released state dict loads as is:
    D → 1024 → 128 → 64 → 16 → 1 with dropout after the first three linear layers."""
    return torch.nn.Sequential(
        torch.nn.Linear(embed_dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
        torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))


@register_reward("aesthetic")
class Aesthetic(DifferentiableReward, Reward):
    value_range = (-np.inf, np.inf)  # a regression head; ratings of real images fall in about 1–10

    def __init__(self, path: str = "", head: str = "", batch_size: int = 32):
        check_clip_dir(path, "aesthetic")
        if not head or not Path(head).is_file():
            raise ValueError(f"reward aesthetic: head {head!r} is not a file; set reward.options.aesthetic.head to the "
                             "predictor's released .pth state dict (sac+logos+ava1-l14-linearMSE.pth)")
        self.path, self.head_path, self.batch_size = path, head, batch_size
        self.clip = self.head = None

    def setup(self, device: str = "cpu") -> None:
        from .clip_backbone import ClipBackbone

        super().setup(device)
        self.clip = ClipBackbone(self.path, device, self.name)
        hp = Path(self.head_path)
        state = torch.load(str(hp), map_location="cpu", weights_only=True)
        state = {k.removeprefix("layers."): v for k, v in state.items()}
        dim = self.clip.model.config.projection_dim
        head = aesthetic_head(dim)
        try:
            head.load_state_dict(state)
        except RuntimeError as exc:
            raise ScoringError(f"reward 'aesthetic': {str(hp)!r} is not a predictor head for {dim}-d CLIP embeddings: "
                               f"{exc}") from exc
        self.head = head.to(device).eval().requires_grad_(False)

    def pixel_scores(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The predicted rating, differentiable in the pixels (DRaFT's and AlignProp's aesthetic reward)."""
        return self.head(self.clip.pixel_embeds(pixels)).squeeze(-1).float()

    @torch.no_grad()
    def score(self, images, prompts, metadata):
        out = [self.head(self.clip.image_embeds(images[s:s + self.batch_size])).squeeze(-1).cpu().numpy()
               for s in range(0, len(images), self.batch_size)]
        return {self.name: np.concatenate(out).astype(np.float32)}
