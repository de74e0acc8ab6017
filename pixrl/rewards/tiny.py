"""Tiny random checkpoints of the model-based rewards in their released layouts (`pixrl
tiny-reward NAME --out DIR`): to try a reward — and what reads one, srpo's or draft's gradient, a soundtrack
reward on LTX-2 — without its weights, as `pixrl tiny FAMILY` does for the models. Each writer
returns the reward.options that load what it wrote."""

from __future__ import annotations

from pathlib import Path


def _clip(out: Path, seed: int) -> dict:
    from .clip_tiny import write_tiny_clip

    return {"path": str(write_tiny_clip(out, seed=seed))}


def _aesthetic(out: Path, seed: int) -> dict:
    """A tiny CLIP and a random LAION predictor head for its embeddings, as the release saves it."""
    import torch

    from .aesthetic import aesthetic_head
    from .clip_tiny import write_tiny_clip

    clip = write_tiny_clip(out / "clip", seed=seed)
    torch.manual_seed(seed)
    head = aesthetic_head(24)  # the tiny CLIP's projection width
    torch.save({f"layers.{k}": v for k, v in head.state_dict().items()}, str(out / "head.pth"))
    return {"path": str(clip), "head": str(out / "head.pth")}


def _imagereward(out: Path, seed: int) -> dict:
    from .imagereward_tiny import write_tiny_imagereward

    path, tokenizer = write_tiny_imagereward(out, seed=seed)
    return {"path": str(path), "tokenizer": str(tokenizer), "vision_heads": 2}


def _clap(out: Path, seed: int) -> dict:
    from .clap_tiny import write_tiny_clap

    return {"path": str(write_tiny_clap(out, seed=seed))}


def _hpsv3(out: Path, seed: int) -> dict:
    from .hpsv3_tiny import write_tiny_hpsv3

    path, base = write_tiny_hpsv3(out, seed=seed)
    return {"path": str(path), "base": str(base), "dtype": "float32"}


def _editreward(out: Path, seed: int) -> dict:
    from .editreward_tiny import write_tiny_editreward

    path, base = write_tiny_editreward(out, seed=seed)
    return {"path": str(path), "base": str(base), "dtype": "float32"}


def _videoalign(out: Path, seed: int) -> dict:
    from .videoalign_tiny import write_tiny_videoalign

    path, base = write_tiny_videoalign(out, seed=seed)
    return {"path": str(path), "base": str(base), "dtype": "float32"}


#: reward → its tiny writer (a PickScore directory is a CLIP one: its processor beside it)
TINY_REWARDS = {"clip_score": _clip, "pickscore": _clip, "aesthetic": _aesthetic, "imagereward": _imagereward, "clap_score": _clap, "hpsv3": _hpsv3,
                "editreward": _editreward, "videoalign": _videoalign}


def write_tiny_reward(name: str, out: Path, seed: int = 0) -> dict:
    """Write `name`'s tiny checkpoint (one of TINY_REWARDS) under `out`; its reward.options."""
    out.mkdir(parents=True, exist_ok=True)
    return TINY_REWARDS[name](out, seed)
