"""A tiny EditReward in the released layout, for tests and for trying the reward without weights: a
Qwen2.5-VL-Instruct checkout (Qwen2_5_VLConfig, the Qwen2 tokenizer with the vision tokens and the
chat template with its default system turn, Qwen2VLImageProcessor at Qwen2.5-VL's pixel bounds)
and `model.safetensors` — a random Qwen2_5_VLForConditionalGeneration whose vocabulary holds
`<|Reward|>`, its keys as transformers 4.57 names them (EditReward's trainer saves the whole
model), and the two reward heads `rm_heads.head_0`, `head_1`."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def write_tiny_editreward(out_dir: Path, hidden: int = 32, seed: int = 0) -> tuple[Path, Path]:
    """(the checkpoint folder holding model.safetensors, the base checkout) under `out_dir`."""
    from safetensors.torch import save_file
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from ..models.tiny_qwen_vl import tiny_qwen25_vl_config
    from .editreward_prompts import FOLLOWING, QUALITY
    from .hpsv3 import ASK, REWARD_TOKEN
    from .hpsv3_tiny import qwen2_vl_tokenizer

    out_dir = Path(out_dir)
    base, ckpt = out_dir / "Qwen2.5-VL-Instruct-tiny", out_dir / "EditReward-tiny"
    base.mkdir(parents=True, exist_ok=True)
    ckpt.mkdir(parents=True, exist_ok=True)
    tok = qwen2_vl_tokenizer(base, FOLLOWING + QUALITY + ASK)
    cfg = tiny_qwen25_vl_config(tok, hidden, positions=4096)
    cfg.save_pretrained(str(base))
    Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056).save_pretrained(str(base))  # Qwen2.5-VL's bounds
    tok.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    cfg.text_config.vocab_size = len(tok)  # as EditReward resized its embeddings for the reward token
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for i in range(2):
        head = nn.Sequential(nn.Linear(hidden, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(),
                             nn.Linear(16, 2))
        state.update({f"rm_heads.head_{i}.{k}": v.contiguous() for k, v in head.state_dict().items()})
    save_file(state, str(ckpt / "model.safetensors"))
    return ckpt, base
