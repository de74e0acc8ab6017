"""Image features from a vision checkpoint in the transformers layout, shared by the rewards that
compare images with each other (`diversity`, `image_similarity`): a CLIP model's image tower
(`get_image_features`), or a self-supervised ViT — DINOv2, DINOv3 — whose `pooler_output` is the
CLS token after the last norm (what timm's head-less DINO models return). Each model uses its own
image processor from the same directory; features come back L2-normalised. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .base import Reward, ScoringError


class ImageFeatureReward(Reward):
    """A reward on image features from the checkpoint at `path` (`self.embed`, after setup)."""

    def __init__(self, path: str = "", batch_size: int = 32):
        check_vision_dir(path, self.name)
        self.path, self.batch_size = path, batch_size
        self.embed = None

    def setup(self, device: str = "cpu") -> None:
        super().setup(device)
        self.embed = image_features(self.path, device, self.name)


def check_vision_dir(path: str, reward: str) -> None:
    """Refuse (in preflight, before anything is written) a path that holds no checkpoint."""
    if not path or not (Path(path) / "config.json").is_file():
        raise ValueError(f"reward {reward}: {path!r} is not a vision checkpoint in the transformers layout (no "
                         f"config.json); set reward.options.{reward}.path to a local CLIP (e.g. "
                         "openai/clip-vit-large-patch14) or DINOv2 / DINOv3 ViT directory (e.g. "
                         "facebook/dinov3-vitl16-pretrain-lvd1689m) saved with save_pretrained")


def image_features(path: str, device: str, reward: str):
    """A function uint8 [B, H, W, 3] → L2-normalised features [B, D] (torch, on `device`)."""
    from transformers import AutoConfig, AutoImageProcessor, AutoModel

    try:
        if AutoConfig.from_pretrained(path).model_type == "clip":
            from .clip_backbone import ClipBackbone

            return ClipBackbone(path, device, reward).image_embeds
        model = AutoModel.from_pretrained(path).to(device).eval().requires_grad_(False)
        processor = AutoImageProcessor.from_pretrained(path)
    except ScoringError:
        raise
    except Exception as exc:  # transformers raises many types; name the path and the cause
        raise ScoringError(f"reward {reward!r}: could not load a vision model from {path!r}: {exc}") from exc

    @torch.no_grad()
    def embed(images: np.ndarray) -> torch.Tensor:
        pixels = processor(images=list(images), return_tensors="pt")["pixel_values"].to(device)
        pooled = getattr(model(pixel_values=pixels), "pooler_output", None)
        if pooled is None:
            raise ScoringError(f"reward {reward!r}: the model at {path!r} ({type(model).__name__}) returns no pooled "
                               "feature; use a CLIP, DINOv2 or DINOv3 ViT checkpoint")
        return torch.nn.functional.normalize(pooled.float(), dim=-1)

    return embed
