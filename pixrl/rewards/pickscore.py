"""PickScore (Kirstain et al., arXiv 2305.01569): a CLIP-H fine-tuned on Pick-a-Pic human
preferences; the score is exp(logit_scale) · cos(image, prompt) under it. As flow_grpo
(`pickscore_scorer.py`) the reward divides by 26 to land near [0, 1]; `pickscore.raw` keeps the
paper's value. Loaded from local directories in the upstream layout: the model
(yuvalkirstain/PickScore_v1, a transformers CLIPModel; `path`) and the processor it is used with
(laion/CLIP-ViT-H-14-laion2B-s32B-b79K; `processor`, default: `path`). Nothing is downloaded.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import Reward, register_reward
from .clip_backbone import PixelGradientReward, check_clip_dir, has_processor


@register_reward("pickscore")
class PickScore(PixelGradientReward, Reward):
    value_range = (-np.inf, np.inf)

    def __init__(self, path: str = "", processor: str = "", batch_size: int = 32, divisor: float = 26.0):
        check_clip_dir(path, "pickscore")
        if not has_processor(processor or path):
            raise ValueError(f"reward pickscore: {processor or path!r} holds no CLIP processor (preprocessor_config.json or "
                             f"processor_config.json, and a tokenizer); PickScore_v1 ships none — set reward.options.pickscore.processor to "
                             f"the CLIP-ViT-H-14 directory it is used with (laion/CLIP-ViT-H-14-laion2B-s32B-b79K)")
        self.path, self.processor_path, self.batch_size, self.divisor = path, processor or path, batch_size, divisor
        self.clip = None

    def setup(self, device: str = "cpu") -> None:
        from .clip_backbone import ClipBackbone

        super().setup(device)
        self.clip = ClipBackbone(self.path, device, self.name, self.processor_path)

    def pixel_scores(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """exp(logit_scale) · cos / divisor, differentiable in the pixels."""
        scale = float(torch.exp(self.clip.model.logit_scale.detach().float()))
        return scale * self.pixel_cosines(pixels, prompts) / self.divisor

    def score(self, images, prompts, metadata):
        scale = float(torch.exp(self.clip.model.logit_scale.detach().float()))
        r = (scale * self.clip.cosines(images, prompts, self.batch_size)).astype(np.float32)
        return {self.name: (r / self.divisor).astype(np.float32), f"{self.name}.raw": r}
