"""The reward service's wire format: JSON with each image (or clip) as base64 of its PNG (MP4)
bytes, the prompts and their metadata. A PNG is lossless, so the served scorer sees the exact
pixels the in-process one would. (flow_grpo's reward server takes pickles; pixrl does not —
unpickling runs code from the sender.)"""

from __future__ import annotations

import base64

import numpy as np

from ..artifacts.media import decode_media, media_bytes


def encode_batch(images: np.ndarray, prompts: list[str], metadata: list[dict]) -> dict:
    return {"images": [base64.b64encode(media_bytes(np.asarray(im, np.uint8))).decode("ascii") for im in images],
            "prompts": list(prompts), "metadata": [dict(m) for m in metadata]}


def decode_images(encoded: list[str]) -> np.ndarray:
    """base64 PNG/MP4 strings → uint8 [B, H, W, 3] (or clips [B, F, H, W, 3]); ValueError naming
    the first bad item."""
    out = []
    for i, s in enumerate(encoded):
        try:
            out.append(decode_media(base64.b64decode(s, validate=True)))
        except Exception as exc:  # binascii, PIL and PyAV raise many types
            raise ValueError(f"images[{i}] is not a base64 PNG/MP4: {exc}") from None
    shapes = {im.shape for im in out}
    if len(shapes) > 1:
        raise ValueError(f"images of different shapes in one request: {sorted(shapes)}")
    return np.stack(out)
