"""Pretrains the shapes-world miniature on rendered scenes with captions, on CPU.

Phase 1 trains the VAE (32×32 px ↔ 8×8×4) on renders; its latent statistics become the
pipeline's scaling/shift factors. Phase 2 trains the transformer and both text encoders with
rectified flow (x_t = (1−t)x0 + tε, target ε − x0) on VAE latents, with 10% empty captions for
classifier-free guidance, adaLN-zero init and an EMA. Only train-split captions are used, so
held-out compositions stay unseen. Both phases have fixed step budgets (with cosine schedules
over them), so a run is reproducible from its seed at a given thread count.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ...datasets.shapes.judge import judge
from ...datasets.shapes.prompts import flip_relation, split_prompts
from ...datasets.shapes.render import render, render_prompt, sample_scene
from .build import MiniSpec, build_pipeline, save_pipeline
from .schedule import ema_update, warmup_cosine
from .text_towers import train_text_towers


@dataclass
class PretrainConfig:
    seed: int = 0
    vae_steps: int = 600
    denoiser_steps: int = 2000
    batch_size: int = 64
    vae_lr: float = 1e-3
    lr: float = 6e-4
    warmup_steps: int = 200
    kl_weight: float = 1e-6
    caption_dropout: float = 0.1
    ema_decay: float = 0.999
    save_every_steps: int = 500
    threads: int = 1
    text_steps: int = 0  # > 0: CLIP-pretrain the text encoders first (text_towers.py), then freeze them
    text_batch_size: int = 256
    text_lr: float = 1e-3
    relation_twins: float = 0.0  # fraction of each denoiser batch made of relation-flipped twin pairs


#: the largest share of pretraining captions position prompts get. The wider grammar has 232
#: train position prompts of 353 (colour × position); drawn uniformly they would be two thirds of
#: every batch, and this model cannot read relations (docs/miniature.md § Position). The first
#: grammar's share was 17%.
POSITION_SHARE = 0.2


def caption_weights(prompts: list[dict], position_share: float = POSITION_SHARE) -> np.ndarray | None:
    """Sampling probabilities of the train captions: uniform (None), except that position prompts
    together get at most `position_share` of the draws."""
    pos = np.array([p["category"] == "position" for p in prompts])
    if not pos.any() or pos.all() or pos.mean() <= position_share:
        return None
    w = np.where(pos, position_share / pos.sum(), (1 - position_share) / (~pos).sum())
    return w / w.sum()


class SceneStream:
    """Endless batches of (uint8 image, caption) from train-split prompts, deterministic per seed."""

    def __init__(self, seed: int):
        self.prompts = split_prompts()["train"]
        self.weights = caption_weights(self.prompts)
        self.rng = np.random.default_rng(seed)
        texts = {p["prompt"] for p in self.prompts}
        # relation prompts whose flip ("left of" <-> "right of") is a train prompt too; the split
        # holds out a pair's relations together, so this is every train relation prompt
        self.twinnable = [p for p in self.prompts if p.get("relation") and flip_relation(p)["prompt"] in texts]

    def twin_batch(self, n_pairs: int) -> tuple[torch.Tensor, list[str], list[dict]]:
        """`n_pairs` relation scenes, then the same scenes with the two shapes' cells exchanged under
        the flipped caption: [a_1..a_k, b_1..b_k]. A twin differs from its scene only in the
        relation word and the layout, so a text-blind denoiser cannot fit both."""
        if not self.twinnable:
            raise ValueError("relation_twins needs train prompts with a relation whose flip is also in train")
        idx = self.rng.integers(len(self.twinnable), size=n_pairs)
        metas, twins, images, flipped = [], [], [], []
        for i in idx:
            meta = self.twinnable[i]
            first, second = sample_scene(meta, self.rng)
            metas.append(meta)
            twins.append(flip_relation(meta))
            images.append(render([first, second]))
            flipped.append(render([replace(first, row=second.row, col=second.col),
                                   replace(second, row=first.row, col=first.col)]))
        both = metas + twins
        return _to_tensor(np.stack(images + flipped)), [m["prompt"] for m in both], both

    def batch(self, n: int) -> tuple[torch.Tensor, list[str], list[dict]]:
        if self.weights is None:
            idx = self.rng.integers(len(self.prompts), size=n)
        else:
            idx = self.rng.choice(len(self.prompts), size=n, p=self.weights)
        seeds = self.rng.integers(2**31, size=n)
        metas = [self.prompts[i] for i in idx]
        return self.render(list(zip(metas, seeds))), [m["prompt"] for m in metas], metas

    @staticmethod
    def render(items: list[tuple[dict, int]]) -> torch.Tensor:
        """Renders of (metadata, seed) as a float batch in [-1, 1], NCHW."""
        return _to_tensor(np.stack([render_prompt(m, int(s)) for m, s in items]))


def _to_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W, 3] → float NCHW in [-1, 1] (the inverse of `_to_uint8`)."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def _to_uint8(x: torch.Tensor) -> np.ndarray:
    return ((x.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()


def train_vae(vae, stream: SceneStream, cfg: PretrainConfig, log: Callable[[dict], None]) -> None:
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    start = time.time()
    for step in range(1, cfg.vae_steps + 1):
        x, _, _ = stream.batch(cfg.batch_size)
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample()).sample
        kl = post.kl().mean() / x[0].numel()
        loss = F.mse_loss(rec, x) + F.l1_loss(rec, x) + cfg.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        frac = step / cfg.vae_steps
        for g in opt.param_groups:
            g["lr"] = cfg.vae_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        opt.step()
        if step % 100 == 0:
            with torch.no_grad():
                xe, _, metas = stream.batch(64)
                rec_e = vae.decode(vae.encode(xe).latent_dist.mode()).sample
                acc = np.mean([judge(im, m)["correct"] for im, m in zip(_to_uint8(rec_e), metas)])
            log({"phase": "vae", "step": step, "loss": float(loss), "recon_judge_acc": float(acc),
                 "minutes": (time.time() - start) / 60})


@torch.no_grad()
def set_latent_stats(vae, stream: SceneStream, n: int = 2048) -> dict:
    zs = []
    for _ in range(n // 64):
        x, _, _ = stream.batch(64)
        zs.append(vae.encode(x).latent_dist.mode())
    z = torch.cat(zs)
    shift, scale = float(z.mean()), float(1.0 / z.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return {"shift_factor": shift, "scaling_factor": scale}


def _adaln_zero(transformer) -> None:
    """Zero the modulation and output projections: every block starts as the identity."""
    for name, mod in transformer.named_modules():
        if name.endswith(("norm1.linear", "norm1_context.linear", "norm_out.linear")) or name == "proj_out":
            torch.nn.init.zeros_(mod.weight)
            if mod.bias is not None:
                torch.nn.init.zeros_(mod.bias)


def _sample_t(n: int, gen: torch.Generator) -> torch.Tensor:
    """50% logit-normal(0, 1), 50% uniform: covers the high- and low-noise ends."""
    ln = torch.sigmoid(torch.randn(n, generator=gen))
    un = torch.rand(n, generator=gen)
    pick = torch.rand(n, generator=gen) < 0.5
    return torch.where(pick, ln, un).clamp(1e-4, 1 - 1e-4)


def _twin_noise(n: int, n_pairs: int, shape: tuple, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """t and ε for a batch whose last 2·n_pairs samples are twin pairs [a.., b..]: each twin gets
    its scene's t and ε, so the only difference the loss sees is the caption and the layout."""
    t = _sample_t(n - n_pairs, gen)
    eps = torch.randn((n - n_pairs, *shape), generator=gen)
    if n_pairs:
        t = torch.cat([t, t[-n_pairs:]])
        eps = torch.cat([eps, eps[-n_pairs:]])
    return t, eps


def trained_modules(pipe, cfg: PretrainConfig) -> list:
    """What the denoiser phase trains (and keeps an EMA of): the transformer, plus the text
    encoders unless they were CLIP-pretrained."""
    if cfg.text_steps:
        return [pipe.transformer]
    return [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2]


def train_denoiser(pipe, stream: SceneStream, cfg: PretrainConfig, log: Callable[[dict], None],
                   on_save: Callable[[dict], None]) -> None:
    modules = trained_modules(pipe, cfg)
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.requires_grad_(True)
        m.train()
    pipe.vae.requires_grad_(False)
    if cfg.text_steps:  # pretrained text towers stay frozen, as SD3's are
        pipe.text_encoder.requires_grad_(False)
        pipe.text_encoder_2.requires_grad_(False)
    _adaln_zero(pipe.transformer)
    ema = [copy.deepcopy(m).requires_grad_(False) for m in modules]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    vcfg = pipe.vae.config
    start = time.time()
    n_pairs = round(cfg.relation_twins * cfg.batch_size / 2)
    for step in range(1, cfg.denoiser_steps + 1):
        x, captions, _ = stream.batch(cfg.batch_size - 2 * n_pairs)
        if n_pairs:
            xt, ct, _ = stream.twin_batch(n_pairs)
            x, captions = torch.cat([x, xt]), captions + ct
        with torch.no_grad():
            z0 = (pipe.vae.encode(x).latent_dist.sample(generator=gen) - vcfg.shift_factor) * vcfg.scaling_factor
        drop = torch.rand(len(captions), generator=gen) < cfg.caption_dropout
        captions = ["" if d else c for c, d in zip(captions, drop.tolist())]
        embeds, _, pooled, _ = pipe.encode_prompt(prompt=captions, prompt_2=None, prompt_3=None,
                                                  do_classifier_free_guidance=False, max_sequence_length=0)
        t, eps = _twin_noise(len(captions), n_pairs, z0.shape[1:], gen)
        tb = t.view(-1, 1, 1, 1)
        zt = (1 - tb) * z0 + tb * eps
        v = pipe.transformer(hidden_states=zt, timestep=t * 1000, encoder_hidden_states=embeds,
                             pooled_projections=pooled, return_dict=False)[0]
        loss = F.mse_loss(v, eps - z0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        lr = warmup_cosine(cfg.lr, step, cfg.denoiser_steps, cfg.warmup_steps, floor=0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        ema_update([pe for e in ema for pe in e.parameters()], [pm for m in modules for pm in m.parameters()],
                   step, cfg.ema_decay)
        if step % 100 == 0:
            log({"phase": "denoiser", "step": step, "loss": float(loss), "grad_norm": float(gnorm), "lr": lr,
                 "minutes": (time.time() - start) / 60})
        if step % cfg.save_every_steps == 0 and step < cfg.denoiser_steps:
            on_save({"step": step, "ema": ema})
    on_save({"step": cfg.denoiser_steps, "ema": ema, "final": True})


def pretrain(out_dir: Path, cfg: PretrainConfig, spec: MiniSpec | None = None,
             log: Callable[[dict], None] = print, on_checkpoint: Callable[[Path, int], None] | None = None) -> Path:
    """Build, pretrain and save the miniature to `out_dir` (diffusers layout, EMA weights)."""
    spec = spec or MiniSpec()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _pretrain(out_dir, cfg, spec, log, on_checkpoint)
    finally:  # the caller's thread count: bit-identical results elsewhere in the process depend on it
        torch.set_num_threads(threads)


def _pretrain(out_dir: Path, cfg: PretrainConfig, spec: MiniSpec, log: Callable[[dict], None],
              on_checkpoint: Callable[[Path, int], None] | None) -> Path:
    torch.manual_seed(cfg.seed)
    work = out_dir.parent / (out_dir.name + ".build")
    pipe = build_pipeline(spec, cfg.seed, work)
    stream = SceneStream(cfg.seed)
    pipe.vae.train()
    train_vae(pipe.vae, stream, cfg, log)
    pipe.vae.eval()
    log({"phase": "latent_stats", **set_latent_stats(pipe.vae, stream)})
    if cfg.text_steps:
        train_text_towers(pipe, stream, cfg.text_steps, cfg.text_batch_size, cfg.text_lr, cfg.seed, log)

    def save(state: dict) -> None:
        export = copy.copy(pipe)
        live = trained_modules(pipe, cfg)
        backup = [copy.deepcopy(m.state_dict()) for m in live]
        for m, e in zip(live, state["ema"]):
            m.load_state_dict(e.state_dict())
        tmp = out_dir.parent / (out_dir.name + ".tmp")
        save_pipeline(export, tmp, spec)
        (tmp / "pixrl_pretrain.json").write_text(json.dumps({"config": cfg.__dict__, "denoiser_steps": state["step"]},
                                                            indent=2))
        for m, b in zip(live, backup):
            m.load_state_dict(b)
        if out_dir.exists():
            import shutil

            shutil.rmtree(out_dir)
        tmp.rename(out_dir)  # publish whole: a reader never sees a half-written checkpoint
        log({"phase": "saved", "step": state["step"], "path": str(out_dir)})
        if on_checkpoint:
            on_checkpoint(out_dir, state["step"])

    train_denoiser(pipe, stream, cfg, log, save)
    import shutil

    shutil.rmtree(work, ignore_errors=True)  # tokenizer build files; the saved pipeline has its own copy
    return out_dir
