"""Reads the released HPSv3.safetensors: the state dict of its Qwen2-VL reward model as
transformers 4.45 named it (`model.*` the language model, `visual.*` the vision tower, `lm_head`)
plus the reward head (`rm_head.0/3/5`: Linear, ReLU, Dropout, Linear, ReLU, Linear), onto
transformers 5's Qwen2VLForConditionalGeneration (`model.language_model.*`, `model.visual.*`)
built from the base checkout's config, its vocabulary resized as HPSv3 resized it for `<|Reward|>`."""

from __future__ import annotations

import torch
from torch import nn

from .base import ScoringError

HEAD_LAYERS = (0, 3, 5)  # the Linear layers of the head (1: ReLU, 2: Dropout, 4: ReLU)


def to_transformers5(key: str) -> str:
    """A transformers 4.45 Qwen2-VL key in transformers 5's layout (keys already in it are kept)."""
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model.") and not key.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + key[len("model."):]
    return key


def reward_head(state: dict[str, torch.Tensor], path: str, reward: str = "hpsv3", prefix: str = "rm_head.",
                fix: str = "is it a plain Qwen2-VL checkpoint? Set reward.options.hpsv3.path to HPSv3.safetensors"
                ) -> nn.Sequential:
    """HPSv3's `ranknet` head (EditReward's heads share its shape) with the checkpoint's widths, in
    float32 (as both keep it); `state` holds the head's keys without `prefix`."""
    want = [f"{i}.{p}" for i in HEAD_LAYERS for p in ("weight", "bias")]
    lacking = [k for k in want if k not in state]
    if lacking:
        raise ScoringError(f"reward {reward}: {path!r} holds no reward head ({prefix}{lacking[0]} is missing); {fix}")
    (h0, d), (h1, _), (out, _) = (tuple(state[f"{i}.weight"].shape) for i in HEAD_LAYERS)
    head = nn.Sequential(nn.Linear(d, h0), nn.ReLU(), nn.Dropout(0.05), nn.Linear(h0, h1), nn.ReLU(),
                         nn.Linear(h1, out))
    head.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return head.float()


def load_hpsv3(path: str, base: str, vocab: int, dtype: torch.dtype):
    """(the Qwen2-VL model in `dtype`, the reward head in float32) from HPSv3.safetensors on the
    base checkout's config; `vocab`: the tokenizer's size with `<|Reward|>` added."""
    from accelerate import init_empty_weights
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    state = load_file(path, device="cpu")
    head = reward_head({k[len("rm_head."):]: v for k, v in state.items() if k.startswith("rm_head.")}, path)
    body = {to_transformers5(k): v.to(dtype) for k, v in state.items() if not k.startswith("rm_head.")}
    embed = body.get("model.language_model.embed_tokens.weight")
    if embed is None or embed.shape[0] != vocab:
        raise ScoringError(f"reward hpsv3: {path!r} embeds {None if embed is None else embed.shape[0]} tokens and the "
                           f"tokenizer of {base!r} with {'<|Reward|>'} has {vocab}; set reward.options.hpsv3.base to the "
                           f"Qwen2-VL-7B-Instruct checkout HPSv3 was tuned from")
    config = AutoConfig.from_pretrained(base)
    config.text_config.vocab_size = vocab
    with init_empty_weights(include_buffers=False):
        model = Qwen2VLForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict(body, strict=False, assign=True)
    tied = bool(config.tie_word_embeddings)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ScoringError(f"reward hpsv3: {path!r} does not fit the Qwen2-VL of {base!r}: "
                           f"{len(missing)} missing (e.g. {missing[:2]}), {len(unexpected)} unexpected "
                           f"(e.g. {unexpected[:2]}); is base Qwen2-VL-7B-Instruct?")
    if tied:
        model.tie_weights()
    return model.to(dtype), head
