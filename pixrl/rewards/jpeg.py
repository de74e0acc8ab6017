"""DDPO's JPEG (in)compressibility rewards (algorithms.md §10): ∓ JPEG size in kB at quality 95."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from .base import Reward, register_reward


def jpeg_kilobytes(image: np.ndarray, quality: int = 95) -> float:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


@register_reward("jpeg_compressibility")
class JpegCompressibility(Reward):
    """Higher for images that compress to fewer bytes."""

    value_range = (-np.inf, 0.0)

    def __init__(self, quality: int = 95):
        self.quality = quality

    def score(self, images, prompts, metadata):
        return {self.name: np.array([-jpeg_kilobytes(im, self.quality) for im in images], dtype=np.float32)}


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(JpegCompressibility):
    """Higher for images that need more bytes (DDPO's incompressibility task)."""

    value_range = (0.0, np.inf)

    def score(self, images, prompts, metadata):
        return {self.name: np.array([jpeg_kilobytes(im, self.quality) for im in images], dtype=np.float32)}
