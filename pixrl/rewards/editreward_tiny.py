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


def tiny_qwen25_vl_config(tok, hidden: int = 32):
    """A two-layer Qwen2.5-VL (its vision tower: 14-px patches, 2×2 merge, one full-attention block)."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>")}
    special = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "bos_token_id": tok.pad_token_id}
    heads = 2
    half = hidden // heads // 2
    sections = [half * 2 // 8, half * 3 // 8, half - half * 2 // 8 - half * 3 // 8]
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=4096, **special,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": sections}),
        vision_config=dict(depth=1, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=2,
                           out_hidden_size=hidden, fullatt_block_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], **special)


def write_tiny_editreward(out_dir: Path, hidden: int = 32, seed: int = 0) -> tuple[Path, Path]:
    """(the checkpoint folder holding model.safetensors, the base checkout) under `out_dir`."""
    from safetensors.torch import save_file
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from .editreward_prompts import FOLLOWING, QUALITY
    from .hpsv3 import ASK, REWARD_TOKEN
    from .hpsv3_tiny import qwen2_vl_tokenizer

    out_dir = Path(out_dir)
    base, ckpt = out_dir / "Qwen2.5-VL-Instruct-tiny", out_dir / "EditReward-tiny"
    base.mkdir(parents=True, exist_ok=True)
    ckpt.mkdir(parents=True, exist_ok=True)
    tok = qwen2_vl_tokenizer(base, FOLLOWING + QUALITY + ASK)
    cfg = tiny_qwen25_vl_config(tok, hidden)
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
