"""A CLIP model loaded from a local directory in the transformers layout (CLIPModel + its
processor: `save_pretrained` output, or a Hugging Face snapshot such as
openai/clip-vit-large-patch14 copied to disk), shared by the CLIP-based rewards. Loading happens
in the reward's `setup()`, once per process, on the reward's device; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .base import ScoringError
from .differentiable import DifferentiableReward


def check_clip_dir(path: str, reward: str) -> None:
    """Refuse (in preflight, before anything is written) a path that is not a CLIP checkpoint."""
    if not path or not (Path(path) / "config.json").is_file():
        raise ValueError(f"reward {reward}: {path!r} is not a CLIP checkpoint in the transformers layout (no "
                         f"config.json); set reward.options.{reward}.path to a local CLIPModel directory (e.g. "
                         "openai/clip-vit-large-patch14 saved with save_pretrained)")


def has_processor(path: str) -> bool:
    """Whether a directory holds a CLIP processor: its image preprocessing (a Hub snapshot's
    preprocessor_config.json, or transformers 5's processor_config.json) and a tokenizer."""
    p = Path(path)
    return any((p / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")) and any(
        (p / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json"))


class ClipBackbone:
    """`processor_path`: where the processor lives when the model directory has none (PickScore_v1
    is used with the processor of laion/CLIP-ViT-H-14-laion2B-s32B-b79K)."""

    def __init__(self, path: str, device: str = "cpu", reward: str = "clip", processor_path: str | None = None):
        from transformers import CLIPModel, CLIPProcessor

        p, pp = Path(path), Path(processor_path or path)
        try:
            self.model = CLIPModel.from_pretrained(str(p)).to(device).eval().requires_grad_(False)
            self.processor = CLIPProcessor.from_pretrained(str(pp))
        except Exception as exc:  # transformers raises many types; name the path and the cause
            raise ScoringError(f"reward {reward!r}: could not load CLIP from {str(p)!r} (processor {str(pp)!r}): "
                               f"{exc}") from exc
        self.device = device

    @classmethod
    def of(cls, model, processor, device: str = "cpu") -> "ClipBackbone":
        """The shared embedding code over a CLIPModel built elsewhere (HPSv2's converted open_clip)."""
        self = cls.__new__(cls)
        self.model, self.processor, self.device = model.to(device).eval().requires_grad_(False), processor, device
        return self

    @torch.no_grad()
    def image_embeds(self, images: np.ndarray) -> torch.Tensor:
        """uint8 [B, H, W, 3] → L2-normalised image embeddings [B, D]."""
        pixels = self.processor(images=list(images), return_tensors="pt")["pixel_values"].to(self.device)
        emb = self.model.get_image_features(pixel_values=pixels)
        emb = getattr(emb, "pooler_output", emb)
        return torch.nn.functional.normalize(emb.float(), dim=-1)

    def cosines(self, images: np.ndarray, prompts: list[str], batch_size: int) -> np.ndarray:
        """cos(image, its prompt) per sample [B], float32, in batches of `batch_size`."""
        out = []
        for s in range(0, len(images), batch_size):
            img = self.image_embeds(images[s:s + batch_size])
            txt = self.text_embeds(list(prompts[s:s + batch_size]))
            out.append((img * txt).sum(-1).cpu().numpy())
        return np.concatenate(out).astype(np.float32)

    def pixel_embeds(self, pixels: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [0, 1] → L2-normalised image embeddings [B, D], differentiable
        in the pixels: the processor's steps as tensor operations — shortest edge to its size
        (bicubic, antialiased), centre crop, mean/std — where `image_embeds` runs them in PIL
        (equal for images already at the crop size)."""
        from .differentiable import normalize, resize_crop

        ip = self.processor.image_processor
        short = _size_of(ip.size, "shortest_edge")
        x = resize_crop(pixels, short, _size_of(ip.crop_size, "height"), _size_of(ip.crop_size, "width"))
        x = normalize(x, ip.image_mean, ip.image_std)
        emb = self.model.get_image_features(pixel_values=x.to(self.device))
        emb = getattr(emb, "pooler_output", emb)
        return torch.nn.functional.normalize(emb.float(), dim=-1)

    @torch.no_grad()
    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        """Prompts → L2-normalised text embeddings [B, D] (truncated to the tower's context)."""
        tok = self.processor.tokenizer(prompts, padding=True, truncation=True, return_tensors="pt").to(self.device)
        emb = self.model.get_text_features(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
        emb = getattr(emb, "pooler_output", emb)
        return torch.nn.functional.normalize(emb.float(), dim=-1)


def _size_of(size, key: str) -> int:
    """A processor size entry (transformers 5's SizeDict, or a plain dict)."""
    value = getattr(size, key, None)
    return int(value if value is not None else size[key])


class PixelGradientReward(DifferentiableReward):
    """What a reward-gradient algorithm (`srpo`) reads of a CLIP-based reward (mixed into it):
    embeddings of decoded pixels, differentiable; of texts, frozen; and the factor SRPO scales
    their similarity by (HPSv2: 1 — the cosine; CLIP and PickScore: exp(logit_scale)/20, SRPO's
    scaling to HPS's range). The reward's `clip` backbone is loaded by its `setup`."""

    clip: "ClipBackbone"

    def embed_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.clip.pixel_embeds(pixels)

    def embed_texts(self, texts: list[str]) -> torch.Tensor:
        return self.clip.text_embeds(texts)

    def srp_scale(self) -> float:
        return float(torch.exp(self.clip.model.logit_scale.detach().float())) / 20.0

    def pixel_cosines(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """cos(image, its prompt) per sample [B], differentiable in the pixels."""
        return (self.embed_pixels(pixels) * self.embed_texts(list(prompts))).sum(-1)

    def pixel_scores(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The reward's main value (the cosine: clip_score, hpsv2), differentiable (`draft`, `refl`)."""
        return self.pixel_cosines(pixels, prompts)
