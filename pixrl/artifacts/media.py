"""Sample grids for MLflow: one row per prompt group, one column per group member."""

from __future__ import annotations

import numpy as np


def image_grid(images: np.ndarray, cols: int, pad: int = 2, scale: int = 1) -> np.ndarray:
    """uint8 [N, H, W, 3] → one uint8 grid image, padded in white, optionally upscaled."""
    n, h, w, c = images.shape
    rows = (n + cols - 1) // cols
    grid = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, c), 255, np.uint8)
    for i, im in enumerate(images):
        r, q = divmod(i, cols)
        grid[pad + r * (h + pad): pad + r * (h + pad) + h, pad + q * (w + pad): pad + q * (w + pad) + w] = im
    if scale > 1:
        grid = grid.repeat(scale, 0).repeat(scale, 1)
    return grid


def png_bytes(image: np.ndarray, compress_level: int = 6) -> bytes:
    """uint8 [H, W, 3] → PNG (lossless: the scored pixels are the stored pixels). Level 1 encodes
    an upscaled sample grid 4× faster than the default 6 for 25% more bytes."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=compress_level)
    return buf.getvalue()


def decode_png(data: bytes) -> np.ndarray:
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
