"""Qwen-VL model inputs as Qwen's processor builds them, without the processor class (it insists
on a video processor, which needs torchvision): the chat template with an image placeholder per
image, each placeholder expanded to its image's patch count (grid t·h·w / merge²), the image
processor's pixels, and `mm_token_type_ids` (1 at image tokens) as the processor returns them —
without it transformers' Qwen2.5-VL forward quietly places every token at plain sequential
positions instead of its image-aware M-RoPE grid (and Qwen2-VL / Qwen3-VL refuse). Shared by the
rewards that read a Qwen-VL model (vlm_judge, pairwise_judge, hpsv3)."""

from __future__ import annotations

import torch


def chat_inputs(tokenizer, image_processor, image_token: str, image_sets: list[list], texts: list[str],
                captions: tuple[str, ...] = (), device="cpu", dtype=torch.float32) -> dict[str, torch.Tensor]:
    """One user turn per row: its images (each after its caption, when given), then its text;
    padded on the tokenizer's side. Images are uint8 arrays or PIL images."""
    flat = [img for images in image_sets for img in images]
    pix = image_processor(images=flat, return_tensors="pt")
    merge = image_processor.merge_size ** 2
    grids = iter(pix["image_grid_thw"])
    rows = []
    for images, text in zip(image_sets, texts):
        content = []
        for k in range(len(images)):
            if captions:
                content.append({"type": "text", "text": captions[k]})
            content.append({"type": "image"})
        msg = [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]
        chat = tokenizer.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
        for _ in images:  # left to right: the k-th placeholder is the k-th image
            n = int(next(grids).prod()) // merge
            chat = chat.replace(image_token, "\0" * n, 1)
        rows.append(chat.replace("\0", image_token))
    enc = tokenizer(rows, return_tensors="pt", padding=True, add_special_tokens=False)
    ids = enc["input_ids"]
    image_tokens = (ids == tokenizer.convert_tokens_to_ids(image_token)).to(torch.int32)
    return {"input_ids": ids.to(device), "attention_mask": enc["attention_mask"].to(device),
            "mm_token_type_ids": image_tokens.to(device),  # 1 at image tokens: the model's M-RoPE positions
            "pixel_values": pix["pixel_values"].to(device, dtype), "image_grid_thw": pix["image_grid_thw"].to(device)}
