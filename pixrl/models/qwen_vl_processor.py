"""What transformers' Qwen2VLProcessor computes for texts holding image placeholders and their
images — the image processor's pixels and grids, each `<|image_pad|>` expanded to its image's
patch count (grid t·h·w / merge²), the tokenizer's ids and mask, and `mm_token_type_ids` (1 at
image tokens) — without the class itself, which transformers builds only with torchvision (its
video processor). Used where a pipeline or a reward holds a Qwen-VL processor (Qwen-Image-Edit's
text encoder, the Qwen-VL rewards), read from the same files (`processor/` of a checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch


from transformers import ProcessorMixin


class QwenVLProcessor(ProcessorMixin):
    """A ProcessorMixin by type only (a pipeline checks its processor's class); ProcessorMixin's
    own construction, which insists on every sub-processor, is not run."""

    def __init__(self, image_processor, tokenizer, image_token: str = "<|image_pad|>"):  # noqa: D107
        self.image_processor, self.tokenizer, self.image_token = image_processor, tokenizer, image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "QwenVLProcessor":
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil  # the PIL one: no torchvision

        return cls(Qwen2VLImageProcessorPil.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(folder)))

    def __repr__(self) -> str:
        return f"QwenVLProcessor({type(self.image_processor).__name__}, {type(self.tokenizer).__name__})"

    def save_pretrained(self, folder: str | Path, **_) -> None:
        self.image_processor.save_pretrained(str(folder))
        self.tokenizer.save_pretrained(str(folder))

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    def apply_chat_template(self, conversation, tokenize: bool = False, return_dict: bool = False,
                            add_generation_prompt: bool = False, **kwargs):
        """The conversation (or a batch of them) under the checkout's chat template, as the
        processor's own method renders it; tokenized: the ids of each, as a batch."""
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                    **kwargs) for c in (conversation if batched else [conversation])]
        if not tokenize:
            return texts if batched else texts[0]
        out = self(text=texts, return_tensors=None, padding=False)
        return out if return_dict else out["input_ids"]

    def __call__(self, text: str | list[str], images=None, padding=True, return_tensors: str | None = "pt",
                 padding_side: str | None = None, **_):
        """A BatchFeature of input_ids, attention_mask, mm_token_type_ids and — with images, one per
        placeholder in reading order — pixel_values and image_grid_thw; `padding_side` for this call."""
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
        side = {"padding_side": padding_side} if padding_side else {}
        enc = self.tokenizer(texts, return_tensors=return_tensors, padding=padding, **side)
        marks = [[int(i == self.image_token_id) for i in row] for row in enc["input_ids"]] if return_tensors is None \
            else (enc["input_ids"] == self.image_token_id).to(torch.int32)
        out.update(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], mm_token_type_ids=marks)
        return BatchFeature(out, tensor_type=return_tensors)
