"""What the Qwen-VL reward tests share: the upstream inferencers' image size, written out."""

import math


def upstream_size(h: int, w: int, factor: int = 28, pixels: int = 256 * 28 * 28) -> tuple[int, int]:
    """qwen-vl-utils' smart_resize as HPSv3's and EditReward's copies run it at min_pixels =
    max_pixels = `pixels`: (height, width) on the `factor` grid."""
    hb, wb = max(factor, round(h / factor) * factor), max(factor, round(w / factor) * factor)
    if hb * wb > pixels:
        beta = math.sqrt(h * w / pixels)
        hb, wb = math.floor(h / beta / factor) * factor, math.floor(w / beta / factor) * factor
    elif hb * wb < pixels:
        beta = math.sqrt(pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb
