"""Qwen-VL chat inputs as Qwen's processor builds them, without the processor class (it insists
on a video processor, which needs torchvision): each row's chat turn rendered by the checkout's
template, then models/qwen_vl_processor.py — image placeholders expanded to each image's patch
count, the image processor's pixels, and `mm_token_type_ids` (1 at image tokens) as the processor
returns them. Without those marks transformers' Qwen2.5-VL forward quietly places every token at
plain sequential positions instead of its image-aware M-RoPE grid (and Qwen2-VL / Qwen3-VL
refuse). Shared by the rewards that read a Qwen-VL model (vlm_judge, pairwise_judge, hpsv3)."""

from __future__ import annotations

import torch


def chat_inputs(tokenizer, image_processor, image_token: str, image_sets: list[list], texts: list[str],
                captions: tuple[str, ...] = (), device="cpu", dtype=torch.float32) -> dict[str, torch.Tensor]:
    """One user turn per row: its images (each after its caption, when given), then its text;
    padded on the tokenizer's side. Images are uint8 arrays or PIL images."""
    from ..models.qwen_vl_processor import QwenVLProcessor

    rows = []
    for images, text in zip(image_sets, texts):
        content = []
        for k in range(len(images)):
            if captions:
                content.append({"type": "text", "text": captions[k]})
            content.append({"type": "image"})
        msg = [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]
        rows.append(tokenizer.apply_chat_template(msg, tokenize=False, add_generation_prompt=True))
    flat = [img for images in image_sets for img in images]
    enc = QwenVLProcessor(image_processor, tokenizer, image_token)(rows, images=flat)
    return {k: v.to(device, dtype) if k == "pixel_values" else v.to(device) for k, v in enc.items()}


def fixed_area(image, pixels: int):
    """An image as HPSv3's and EditReward's inferencers read it (qwen-vl-utils' fetch_image at
    min_pixels = max_pixels = `pixels`): PIL bicubic to that area on the 28-pixel grid."""
    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    h, w = smart_resize(image.shape[0], image.shape[1], factor=28, min_pixels=pixels, max_pixels=pixels)
    return Image.fromarray(np.asarray(image, dtype=np.uint8)).convert("RGB").resize((w, h), Image.BICUBIC)
