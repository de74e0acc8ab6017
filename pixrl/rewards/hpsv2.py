"""HPSv2 / HPSv2.1 (Wu et al., arXiv 2306.09341): open_clip's ViT-H-14 fine-tuned on human
preference pairs (HPD v2). The score is cos(image, prompt) under it — HPSv2's own `img_score`
takes the diagonal of image_features @ text_features.T with both normalised (≈ 0.2–0.35 on real
images) — and it is DanceGRPO's main image reward.

Loaded from the released checkpoint (`path`: HPS_v2.1_compressed.pt or HPS_v2_compressed.pt,
an open_clip state dict) mapped onto transformers' CLIPModel (rewards/open_clip_convert.py), with
the preprocessing and tokenizer of the CLIP-ViT-H-14 it was fine-tuned from (`processor`: a
local copy of laion/CLIP-ViT-H-14-laion2B-s32B-b79K, the directory PickScore uses too): shortest
edge 224 bicubic, centre crop, OpenAI mean/std, 77 tokens. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .base import Reward, ScoringError, register_reward
from .clip_backbone import PixelGradientReward, has_processor


@register_reward("hpsv2")
class HPSv2(PixelGradientReward, Reward):
    value_range = (-1.0, 1.0)

    def __init__(self, path: str = "", processor: str = "", batch_size: int = 16, vision_heads: int = 16,
                 text_heads: int = 16):
        if not path or not Path(path).is_file():
            raise ValueError(f"reward hpsv2: {path!r} is not a file; set reward.options.hpsv2.path to the released "
                             f"checkpoint (HPS_v2.1_compressed.pt)")
        if not has_processor(processor):
            raise ValueError(f"reward hpsv2: {processor!r} holds no CLIP processor (preprocessor_config.json and a "
                             f"tokenizer); set reward.options.hpsv2.processor to a local copy of "
                             f"laion/CLIP-ViT-H-14-laion2B-s32B-b79K")
        self.path, self.processor_path, self.batch_size = path, processor, batch_size
        self.vision_heads, self.text_heads = vision_heads, text_heads
        self.clip = None

    def setup(self, device: str = "cpu") -> None:
        from transformers import CLIPModel, CLIPProcessor

        from .clip_backbone import ClipBackbone
        from .open_clip_convert import clip_config, read_open_clip, to_transformers

        super().setup(device)
        try:
            processor = CLIPProcessor.from_pretrained(self.processor_path)
            sd = read_open_clip(self.path)
            model = CLIPModel(clip_config(sd, self.vision_heads, self.text_heads, processor.tokenizer))
            model.load_state_dict(to_transformers(sd), strict=True)
        except Exception as exc:  # torch, transformers and shape mismatches raise many types
            raise ScoringError(f"reward 'hpsv2': could not load {self.path!r} with the processor "
                               f"{self.processor_path!r}: {type(exc).__name__}: {exc}") from exc
        self.clip = ClipBackbone.of(model, processor, device)

    def srp_scale(self) -> float:
        return 1.0  # SRPO's HPS: the cosine itself

    @torch.no_grad()
    def score(self, images, prompts, metadata):
        return {self.name: self.clip.cosines(images, prompts, self.batch_size).astype(np.float32)}
