"""Contrastive (CLIP) pretraining of the miniature's text encoders, before the denoiser sees them.

SD3's text encoders arrive pretrained and stay frozen; the miniature's start random. Trained only
through the denoiser's loss, they never separate words whose effect on the pixels is subtle: in
the first shipped model, "left"/"right" (and "above"/"below") produced nearly the same embeddings
(pooled difference ≈ 1% of its norm), so placement stayed at chance whatever the prompt said.
Here each `CLIPTextModelWithProjection` is trained as the text tower of a CLIP model against a
small `CLIPVisionModelWithProjection` on rendered scenes. Captions that differ only in the
relation describe different images, so the contrastive loss must tell them apart — if a batch
holds both. Plain CLIP batches rarely do, which is why CLIP models read captions as bags of
words; every batch here pairs each sample with a hard negative from the train split (same
shapes, different composition: the relation flipped or the pair swapped, colours or counts
changed). Items with the same composition are all positives (soft targets).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ...datasets.shapes.prompts import composition_key, flip_relation


class HardNegativeBatches:
    """Half the batch drawn from the scene stream, half their twins: for each sample a train prompt
    of the same category with the same shapes but another composition (random if none)."""

    def __init__(self, stream, seed: int):
        self.stream = stream
        self.rng = np.random.default_rng(seed)
        shapes = lambda m: sorted(o["shape"] for o in m["objects"])  # noqa: E731
        self.twins = {composition_key(m): [p for p in stream.prompts if p["category"] == m["category"]
                                           and shapes(p) == shapes(m) and composition_key(p) != composition_key(m)]
                      for m in stream.prompts}

    def batch(self, n: int) -> tuple[torch.Tensor, list[str], list[str]]:
        _, _, metas = self.stream.batch(n // 2)
        pool = self.stream.prompts
        twins = [self.twins[composition_key(m)] or pool for m in metas]
        metas = metas + [t[int(self.rng.integers(len(t)))] for t in twins]
        x = self.stream.render([(m, int(s)) for m, s in zip(metas, self.rng.integers(2**31, size=len(metas)))])
        return x, [m["prompt"] for m in metas], [composition_key(m) for m in metas]


def vision_tower(text_encoder, image_size: int, seed: int):
    """A small CLIP image tower with the text tower's projection width."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    tc = text_encoder.config
    cfg = CLIPVisionConfig(image_size=image_size, patch_size=4, hidden_size=tc.hidden_size,
                           intermediate_size=2 * tc.hidden_size, num_hidden_layers=2,
                           num_attention_heads=tc.num_attention_heads, projection_dim=tc.projection_dim)
    return CLIPVisionModelWithProjection(cfg)


def _text_embeds(text_encoder, tokenizer, captions: list[str]) -> torch.Tensor:
    ids = tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
    return text_encoder(ids).text_embeds


def clip_loss(text: torch.Tensor, image: torch.Tensor, keys: list[str], logit_scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE over normalised embeddings; every pair with the same key (composition)
    is a positive."""
    t, v = F.normalize(text, dim=-1), F.normalize(image, dim=-1)
    logits = logit_scale.exp().clamp(max=100.0) * t @ v.T
    codes = {c: i for i, c in enumerate(sorted(set(keys)))}
    lab = torch.tensor([codes[c] for c in keys])
    same = (lab[:, None] == lab[None, :]).float()
    target = same / same.sum(dim=1, keepdim=True)
    return 0.5 * (-(target * logits.log_softmax(dim=1)).sum(1).mean()
                  - (target * logits.T.log_softmax(dim=1)).sum(1).mean())


@torch.no_grad()
def relation_retrieval(text_encoder, tokenizer, vision, stream, n: int = 128) -> float:
    """For images of position prompts: how often the image is closer to its caption than to the
    same caption with the relation flipped ("A left of B" vs "A right of B"). 0.5 = blind to it."""
    metas = [p for p in stream.prompts if p.get("relation")]
    if not metas:
        return float("nan")
    rng = np.random.default_rng(1234)
    picked = [metas[i] for i in rng.integers(len(metas), size=n)]
    x = stream.render([(m, int(s)) for m, s in zip(picked, rng.integers(2**31, size=n))])
    v = F.normalize(vision(pixel_values=x).image_embeds, dim=-1)
    right = F.normalize(_text_embeds(text_encoder, tokenizer, [m["prompt"] for m in picked]), dim=-1)
    wrong = F.normalize(_text_embeds(text_encoder, tokenizer, [flip_relation(m)["prompt"] for m in picked]), dim=-1)
    return float(((v * right).sum(-1) > (v * wrong).sum(-1)).float().mean())


def train_text_towers(pipe, stream, steps: int, batch_size: int, lr: float, seed: int,
                      log: Callable[[dict], None]) -> None:
    """CLIP-train text_encoder and text_encoder_2, each against its own image tower."""
    size = pipe.vae.config.sample_size
    pairs = [(pipe.text_encoder, vision_tower(pipe.text_encoder, size, seed + 11)),
             (pipe.text_encoder_2, vision_tower(pipe.text_encoder_2, size, seed + 12))]
    scales = [torch.nn.Parameter(torch.tensor(math.log(10.0))) for _ in pairs]
    params = [p for te, vt in pairs for p in (*te.parameters(), *vt.parameters())] + scales
    for te, vt in pairs:
        te.requires_grad_(True).train()
        vt.train()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    batches = HardNegativeBatches(stream, seed + 13)
    start = time.time()
    for step in range(1, steps + 1):
        x, captions, keys = batches.batch(batch_size)
        loss = sum(clip_loss(_text_embeds(te, pipe.tokenizer, captions), vt(pixel_values=x).image_embeds, keys, s)
                   for (te, vt), s in zip(pairs, scales))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        warm = min(1.0, step / max(1, steps // 10))
        for g in opt.param_groups:
            g["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        opt.step()
        if step % 100 == 0 or step == steps:
            for te, vt in pairs:
                te.eval()
                vt.eval()
            acc = [relation_retrieval(te, pipe.tokenizer, vt, stream) for te, vt in pairs]
            for te, vt in pairs:
                te.train()
                vt.train()
            log({"phase": "text", "step": step, "loss": float(loss.detach()), "relation_retrieval": acc,
                 "minutes": (time.time() - start) / 60})
    for te, _ in pairs:
        te.eval()
