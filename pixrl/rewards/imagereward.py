"""ImageReward (Xu et al., NeurIPS 2023, arXiv 2304.05977): a BLIP (ViT-L + cross-attending BERT)
fine-tuned on 137k expert preference comparisons. The prompt's [CLS] state, after attending to
the image, goes through a linear MLP head; the score is (head − 0.16717) / 1.03334, the z-score
ImageReward's `score()` returns (≈ −2…2; flow_grpo's `imagereward` reward uses it as is).

Loaded from the release (THUDM/ImageReward on the Hub: `ImageReward.pt` and `med_config.json`;
`path` is the .pt, `med_config` defaults to the file beside it) mapped onto transformers' BLIP
classes (rewards/imagereward_convert.py), with BLIP's tokenizer: a local copy of
bert-base-uncased (`tokenizer`) plus the two tokens BLIP adds ([DEC] as bos, [ENC]); prompts are
padded to 35 tokens as ImageReward does. Images: resize the short side to 224 (bicubic), centre
crop, OpenAI CLIP mean/std — torchvision's Resize/CenterCrop arithmetic, written out so that
torchvision is not needed. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .base import Reward, ScoringError, register_reward
from .differentiable import DifferentiableReward, normalize, resize_crop

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)


def preprocess(image: np.ndarray, size: int) -> np.ndarray:
    """uint8 [H, W, 3] → float32 [3, size, size] as torchvision's Resize(size, BICUBIC) (short
    side to `size`, long side int(size·long/short)), CenterCrop(size) (offset int(round(Δ/2))),
    ToTensor and Normalize(CLIP mean/std) compute it on a PIL image."""
    pil = Image.fromarray(image).convert("RGB")
    w, h = pil.size
    short, long = min(w, h), max(w, h)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    if (new_w, new_h) != (w, h):
        pil = pil.resize((new_w, new_h), Image.BICUBIC)
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    pil = pil.crop((left, top, left + size, top + size))
    x = np.asarray(pil, np.float32) / 255.0
    return ((x - CLIP_MEAN) / CLIP_STD).transpose(2, 0, 1)


@register_reward("imagereward")
class ImageReward(DifferentiableReward, Reward):
    value_range = (-np.inf, np.inf)

    def __init__(self, path: str = "", med_config: str = "", tokenizer: str = "", batch_size: int = 16,
                 max_length: int = 35, vision_heads: int = 0, mean: float = 0.16717362830052426,
                 std: float = 1.0333394966054072):
        if not path or not Path(path).is_file():
            raise ValueError(f"reward imagereward: {path!r} is not a file; set reward.options.imagereward.path to "
                             f"the released ImageReward.pt (THUDM/ImageReward)")
        med_config = med_config or str(Path(path).with_name("med_config.json"))
        if not Path(med_config).is_file():
            raise ValueError(f"reward imagereward: no med_config.json at {med_config!r}; put the release's "
                             f"med_config.json beside ImageReward.pt or set reward.options.imagereward.med_config")
        if not tokenizer or not any((Path(tokenizer) / f).is_file()
                                    for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json")):
            raise ValueError(f"reward imagereward: {tokenizer!r} holds no tokenizer; set "
                             f"reward.options.imagereward.tokenizer to a local copy of bert-base-uncased")
        self.path, self.med_config, self.tokenizer_path = path, med_config, tokenizer
        self.batch_size, self.max_length, self.vision_heads = batch_size, max_length, vision_heads
        self.mean, self.std = mean, std
        self.vision = self.text = self.head = self.tokenizer = None

    def setup(self, device: str = "cpu") -> None:
        from transformers import BertTokenizer, BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        from .imagereward_convert import (read_checkpoint, score_head, text_config, text_state, vision_config,
                                          vision_state)

        super().setup(device)
        try:
            sd = read_checkpoint(self.path)
            vcfg = vision_config(sd, self.vision_heads)
            vision = BlipVisionModel(vcfg)
            vision.load_state_dict(vision_state(sd), strict=True)
            text = BlipTextModel(text_config(self.med_config, vcfg.hidden_size), add_pooling_layer=False)
            text.load_state_dict(text_state(sd), strict=True)
            head = score_head(sd)
            tok = BertTokenizer.from_pretrained(self.tokenizer_path)
            tok.add_special_tokens({"bos_token": "[DEC]"})  # BLIP's init_tokenizer: ids vocab, vocab + 1
            tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
        except Exception as exc:  # torch, transformers and shape mismatches raise many types
            raise ScoringError(f"reward 'imagereward': could not load {self.path!r} (med config {self.med_config!r}, "
                               f"tokenizer {self.tokenizer_path!r}): {type(exc).__name__}: {exc}") from exc
        if len(tok) != text.config.vocab_size:
            raise ScoringError(f"reward 'imagereward': the tokenizer at {self.tokenizer_path!r} has {len(tok)} tokens "
                               f"with [DEC] and [ENC] added, the checkpoint's text encoder {text.config.vocab_size}; "
                               f"use bert-base-uncased's tokenizer")
        self.vision, self.text, self.head = (m.to(device).eval().requires_grad_(False) for m in (vision, text, head))
        self.tokenizer, self.image_size = tok, vcfg.image_size

    @torch.no_grad()
    def _batch(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        pixels = torch.from_numpy(np.stack([preprocess(im, self.image_size) for im in images])).to(self.device)
        return self._forward(pixels, prompts).cpu().numpy()

    def _forward(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The z-scored head of [CLS] after attending to the preprocessed images [B, 3, S, S]."""
        image_embeds = self.vision(pixel_values=pixels).last_hidden_state
        tok = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=self.max_length,
                             return_tensors="pt").to(self.device)
        out = self.text(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"],
                        encoder_hidden_states=image_embeds,
                        encoder_attention_mask=torch.ones(image_embeds.shape[:-1], dtype=torch.long,
                                                          device=self.device))
        raw = self.head(out.last_hidden_state[:, 0, :].float())[:, 0]
        return (raw - self.mean) / self.std

    def pixel_scores(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The score, differentiable in the pixels — ReFL's `score_gard` on the tensor Resize(224,
        bicubic), CenterCrop and Normalize it trains through."""
        x = resize_crop(pixels, self.image_size, self.image_size, self.image_size, round_offsets=True)
        return self._forward(normalize(x, CLIP_MEAN, CLIP_STD).to(self.device), prompts)

    def score(self, images, prompts, metadata):
        out = [self._batch(images[s:s + self.batch_size], prompts[s:s + self.batch_size])
               for s in range(0, len(images), self.batch_size)]
        return {self.name: np.concatenate(out).astype(np.float32)}
