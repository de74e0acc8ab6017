"""What transformers' Qwen2VLProcessor computes for texts holding image placeholders and their
images — the image processor's pixels and grids, each `<|image_pad|>` expanded to its image's
patch count (grid t·h·w / merge²), the tokenizer's ids and mask, and `mm_token_type_ids` (1 at
image tokens) — without the class itself, which transformers builds only with torchvision (its
video processor). Used where a pipeline or a reward holds a Qwen-VL processor (Qwen-Image-Edit's
text encoder, the Qwen-VL rewards), read from the same files (`processor/` of a checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch


class QwenVLProcessor:
    def __init__(self, image_processor, tokenizer, image_token: str = "<|image_pad|>"):
        self.image_processor, self.tokenizer, self.image_token = image_processor, tokenizer, image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "QwenVLProcessor":
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil  # the PIL one: no torchvision

        return cls(Qwen2VLImageProcessorPil.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(folder)))

    def save_pretrained(self, folder: str | Path) -> None:
        self.image_processor.save_pretrained(str(folder))
        self.tokenizer.save_pretrained(str(folder))

    def __call__(self, text: str | list[str], images=None, padding=True, return_tensors: str = "pt", **_):
        """A BatchFeature of input_ids, attention_mask, mm_token_type_ids and — with images, one per
        placeholder in reading order — pixel_values and image_grid_thw."""
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text)
        out = {}
        if images is not None:
            images = list(images) if isinstance(images, (list, tuple)) else [images]
            pix = self.image_processor(images=images, return_tensors="pt")
            out.update(pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"])
            grids, merge = iter(pix["image_grid_thw"]), self.image_processor.merge_size ** 2
            expanded = []
            for t in texts:
                while self.image_token in t:  # left to right: the k-th placeholder is the k-th image
                    t = t.replace(self.image_token, "\0" * (int(next(grids).prod()) // merge), 1)
                expanded.append(t.replace("\0", self.image_token))
            texts = expanded
        enc = self.tokenizer(texts, return_tensors=return_tensors, padding=padding)
        out.update(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                   mm_token_type_ids=(enc["input_ids"] == self.image_token_id).to(torch.int32))
        return BatchFeature(out)
