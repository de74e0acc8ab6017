"""Pretrains the token miniature — Janus-Pro's classes at tiny size on the shapes world — on CPU.

Phase 1 trains the VQ-VAE (32×32 px ↔ 8×8 codes): Janus decodes a token through its codebook
entry *L2-normalised* (`get_codebook_entry`), so training quantises the same way — encoder
output and codebook normalised, nearest code by cosine, straight-through gradients, codebook and
commitment losses — and a code left unused is re-seeded from a current encoding. Phase 2 trains
the decoder (a small Llama) with the generation embeddings, aligner and head on next-image-token
prediction over the VQ tokens of renders, prompts formatted as the family formats them and
replaced by their unconditional form 10% of the time (classifier-free guidance). Only train-split
captions are used, so held-out compositions stay unseen. Fixed step budgets with cosine
schedules: a run is reproducible from its seed at a given thread count.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ...datasets.shapes.judge import judge
from ..janus import JanusProFamily
from .pretrain import SceneStream, _to_uint8
from .schedule import ema_update, warmup_cosine


@dataclass
class TokenPretrainConfig:
    seed: int = 0
    vq_steps: int = 1500
    ar_steps: int = 6000
    vq_batch_size: int = 16  # the VQ-VAE's full-resolution convolutions dominate its step time
    batch_size: int = 32
    dataset_size: int = 24000  # renders tokenized once after phase 1; phase 2 samples batches from them
    vq_lr: float = 1e-3
    lr: float = 1e-3
    warmup_steps: int = 200
    commitment: float = 0.25
    caption_dropout: float = 0.1
    ema_decay: float = 0.999
    threads: int = 2
    codebook: int = 256
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    save_every_steps: int = 1000


def build_model(cfg: TokenPretrainConfig, tokenizer_dir: Path):
    """A random JanusForConditionalGeneration for 32×32 shapes scenes (8×8 tokens), the tokenizer,
    processor files and generation config in the Janus-Pro layout."""
    from transformers import JanusConfig, JanusForConditionalGeneration, JanusVisionConfig, JanusVQVAEConfig, LlamaConfig

    from ..tiny_parts import janus_generation_config, janus_tokenizer

    torch.manual_seed(cfg.seed)
    tok = janus_tokenizer(tokenizer_dir)
    h = cfg.hidden
    text = LlamaConfig(vocab_size=len(tok), hidden_size=h, intermediate_size=2 * h, num_hidden_layers=cfg.layers,
                       num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads, max_position_embeddings=160,
                       pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = JanusVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                               patch_size=4, projection_dim=h, num_image_tokens=64)
    vq = JanusVQVAEConfig(embed_dim=8, num_embeddings=cfg.codebook, latent_channels=64, base_channels=32,
                          channel_multiplier=[1, 2, 2], num_res_blocks=1, projection_dim=h, image_token_embed_dim=h)
    model = JanusForConditionalGeneration(JanusConfig(text_config=text, vision_config=vision, vq_config=vq,
                                                      image_token_id=tok.convert_tokens_to_ids(tok.image_token)))
    model.generation_config = janus_generation_config(tok, guidance_scale=3.0)
    return model, tok


# --- phase 1: the VQ-VAE ------------------------------------------------------------------------
def _encode(vq, x: torch.Tensor) -> torch.Tensor:
    """Normalised encoder output [B, h, w, D]."""
    return F.normalize(vq.quant_conv(vq.encoder(x)).permute(0, 2, 3, 1), dim=-1)


def vq_tokens(vq, x: torch.Tensor) -> torch.Tensor:
    """Image tokens [B, h·w] of images in [-1, 1]: the nearest L2-normalised code (cosine)."""
    z = _encode(vq, x)
    codes = F.normalize(vq.quantize.embedding.weight, dim=-1)
    return (z @ codes.T).argmax(-1).flatten(1)


def train_vq(vq, stream: SceneStream, cfg: TokenPretrainConfig, log: Callable[[dict], None]) -> None:
    opt = torch.optim.AdamW(vq.parameters(), lr=cfg.vq_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    usage = torch.zeros(cfg.codebook)
    start = time.time()
    vq.train()
    for step in range(1, cfg.vq_steps + 1):
        x, _, _ = stream.batch(cfg.vq_batch_size)
        z = _encode(vq, x)
        codes = F.normalize(vq.quantize.embedding.weight, dim=-1)
        idx = (z.detach() @ codes.T).argmax(-1)
        q = codes[idx]
        usage += torch.bincount(idx.flatten(), minlength=cfg.codebook).float()
        quant = z + (q - z).detach()
        rec = vq.decoder(vq.post_quant_conv(quant.permute(0, 3, 1, 2)))
        loss = (F.mse_loss(rec, x) + F.l1_loss(rec, x) + F.mse_loss(q, z.detach())
                + cfg.commitment * F.mse_loss(z, q.detach()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vq.parameters(), 1.0)
        frac = step / cfg.vq_steps
        for g in opt.param_groups:
            g["lr"] = cfg.vq_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        opt.step()
        if step % 100 == 0:
            dead = (usage == 0).nonzero().flatten()
            if len(dead) and step < 0.8 * cfg.vq_steps:  # re-seed unused codes from current encodings
                pool = z.detach().reshape(-1, z.shape[-1])
                pick = torch.randint(len(pool), (len(dead),), generator=gen)
                with torch.no_grad():
                    vq.quantize.embedding.weight[dead] = pool[pick]
            with torch.no_grad():
                xe, _, metas = stream.batch(64)
                rec_e = vq.decode(vq_tokens(vq, xe))  # exactly as JanusVQVAE decodes generated tokens
                acc = np.mean([judge(im, m)["correct"] for im, m in zip(_to_uint8(rec_e), metas)])
            log({"phase": "vq", "step": step, "loss": float(loss.detach()), "codes_used": int((usage > 0).sum()),
                 "recon_judge_acc": float(acc), "minutes": (time.time() - start) / 60})
            usage.zero_()
    vq.eval()


# --- phase 2: the autoregressive decoder ----------------------------------------------------------
@torch.no_grad()
def tokenized_scenes(vq, stream: SceneStream, n: int) -> tuple[torch.Tensor, list[str]]:
    """`n` train-split renders as image tokens [n, 64] with their captions (encoded once)."""
    tokens, captions = [], []
    for _ in range(0, n, 256):
        x, caps, _ = stream.batch(256)
        tokens.append(vq_tokens(vq, x))
        captions += caps
    return torch.cat(tokens)[:n], captions[:n]


def train_decoder(family: JanusProFamily, stream: SceneStream, cfg: TokenPretrainConfig,
                  log: Callable[[dict], None], on_save: Callable[[dict], None]) -> None:
    model = family.model
    vq = model.model.vqmodel
    trained = [p for n, p in model.named_parameters() if not n.startswith(JanusProFamily.frozen_prefixes)]
    model.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    model.train()
    vq.eval()
    ema = [p.detach().clone() for p in trained]
    opt = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    start = time.time()
    data, data_captions = tokenized_scenes(vq, stream, cfg.dataset_size)
    log({"phase": "tokenized", "scenes": len(data), "minutes": (time.time() - start) / 60})
    for step in range(1, cfg.ar_steps + 1):
        pick = torch.randint(len(data), (cfg.batch_size,), generator=gen)
        tokens, captions = data[pick], [data_captions[i] for i in pick.tolist()]
        cond = family.encode_prompts(captions)
        drop = torch.rand(len(captions), generator=gen) < cfg.caption_dropout
        cond.ids = torch.where(drop[:, None], cond.uncond_ids, cond.ids)
        logits = family.sequence_logits(cond, tokens, guided=False)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(trained, 1.0)
        lr = warmup_cosine(cfg.lr, step, cfg.ar_steps, cfg.warmup_steps, floor=0.05)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        ema_update(ema, trained, step, cfg.ema_decay)
        if step % 100 == 0:
            log({"phase": "decoder", "step": step, "loss": float(loss), "grad_norm": float(gnorm), "lr": lr,
                 "minutes": (time.time() - start) / 60})
        if step % cfg.save_every_steps == 0 or step == cfg.ar_steps:
            on_save({"step": step, "ema": ema, "params": trained, "final": step == cfg.ar_steps})
    model.eval()


def pretrain_tokens(out_dir: Path, cfg: TokenPretrainConfig, log: Callable[[dict], None] = print) -> Path:
    """Build, pretrain and save the token miniature to `out_dir` (Janus-Pro transformers layout,
    EMA weights of the decoder), each save published whole."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _pretrain(Path(out_dir), cfg, log)
    finally:
        torch.set_num_threads(threads)


def _pretrain(out_dir: Path, cfg: TokenPretrainConfig, log: Callable[[dict], None]) -> Path:
    from ..tiny_parts import save_janus_processor

    work = out_dir.parent / (out_dir.name + ".build")
    shutil.rmtree(work, ignore_errors=True)
    model, tok = build_model(cfg, work / "tokenizer")
    stream = SceneStream(cfg.seed)
    train_vq(model.model.vqmodel, stream, cfg, log)
    family = JanusProFamily(model, tok, str(out_dir), torch.float32, 0)

    def save(state: dict) -> None:
        live = [p.detach().clone() for p in state["params"]]
        with torch.no_grad():
            for p, e in zip(state["params"], state["ema"]):
                p.copy_(e)
        tmp = out_dir.parent / (out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp))
        save_janus_processor(tmp, tok, side=32, num_image_tokens=64)
        (tmp / "pixrl_pretrain.json").write_text(json.dumps({"config": asdict(cfg), "decoder_steps": state["step"]},
                                                            indent=2))
        with torch.no_grad():
            for p, v in zip(state["params"], live):
                p.copy_(v)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)  # publish whole: a reader never sees a half-written checkpoint
        log({"phase": "saved", "step": state["step"], "path": str(out_dir)})

    train_decoder(family, stream, cfg, log, save)
    shutil.rmtree(work, ignore_errors=True)
    return out_dir

