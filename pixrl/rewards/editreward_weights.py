"""Reads an EditReward checkpoint: the full state dict of its multi-head Qwen2.5-VL reward model
(`model.safetensors`, or `model.pth` as torch saved it, possibly under a "model" key) — the
vision tower and language model in transformers 4.57's layout (`model.visual.*`,
`model.language_model.*`; older `visual.*` / `model.layers.*` names are mapped too), `lm_head`,
and the heads `rm_heads.head_{i}` — onto transformers 5's Qwen2_5_VLModel (the LM head is not
read: the reward reads hidden states) built from the base checkout's config, its vocabulary
resized as EditReward resized it for `<|Reward|>`."""

from __future__ import annotations

import torch
from torch import nn

from .base import ScoringError
from .hpsv3_weights import reward_head, to_transformers5

HEADS = 2  # ranknet_multi_head: one per rubric


def read_state(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state["model"] if "model" in state and isinstance(state["model"], dict) else state


def load_editreward(path: str, base: str, vocab: int, dtype: torch.dtype):
    """(Qwen2_5_VLModel in `dtype`, the heads as a ModuleDict in float32) from the checkpoint on the
    base checkout's config; `vocab`: the tokenizer's size with `<|Reward|>` added."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, Qwen2_5_VLModel

    state = read_state(path)
    fix = "is it an EditReward checkpoint of a multi-head model (rm_head_type ranknet_multi_head)?"
    heads = nn.ModuleDict({f"head_{i}": reward_head(
        {k[len(f"rm_heads.head_{i}."):]: v for k, v in state.items() if k.startswith(f"rm_heads.head_{i}.")},
        path, "editreward", f"rm_heads.head_{i}.", fix) for i in range(HEADS)})
    body = {}
    for key, value in state.items():
        if key.startswith(("rm_heads.", "rm_head.")) or key == "lm_head.weight":
            continue
        key = to_transformers5(key)
        body[key[len("model."):] if key.startswith("model.") else key] = value.to(dtype)
    embed = body.get("language_model.embed_tokens.weight")
    if embed is None or embed.shape[0] != vocab:
        raise ScoringError(f"reward editreward: {path!r} embeds {None if embed is None else embed.shape[0]} tokens "
                           f"and the tokenizer of {base!r} with <|Reward|> has {vocab}; set "
                           "reward.options.editreward.base to the Qwen2.5-VL-7B-Instruct checkout it was tuned from")
    config = AutoConfig.from_pretrained(base)
    if config.model_type != "qwen2_5_vl":
        raise ScoringError(f"reward editreward: {base!r} is a {config.model_type} model; this reward reads the "
                           "Qwen2.5-VL EditReward models (Qwen2.5-VL-7B-Instruct, MiMo-VL-7B), not its Qwen3-VL one")
    config.text_config.vocab_size = vocab
    with init_empty_weights(include_buffers=False):
        model = Qwen2_5_VLModel(config)
    missing, unexpected = model.load_state_dict(body, strict=False, assign=True)
    if missing or unexpected:
        raise ScoringError(f"reward editreward: {path!r} does not fit the Qwen2.5-VL of {base!r}: {len(missing)} "
                           f"missing (e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]}); "
                           "is base the model it was tuned from?")
    return model.to(dtype), heads.float()
