"""Reads a VideoAlign checkpoint (KwaiVGI/VideoAlign's trainer output; the released one is
KlingTeam/VideoReward): `model_config.json` (how it was trained: data, model, LoRA and the
inference normalisation) beside `checkpoint-<step>/` folders holding either `model.pth` (a full
state dict) or `adapter_model.safetensors` (PEFT LoRA on the Qwen2-VL base) and
`non_lora_state_dict.pth` (what else was trained: the reward head, the special tokens'
embeddings, the vision tower). Keys are transformers 4.45's Qwen2-VL layout under PEFT's
`base_model.model.` prefix; they are read into transformers 5's layout, the LoRA applied through
PEFT and merged. The language-model head is never read: the reward uses hidden states only (and
Qwen2-VL-2B ties it to the input embeddings, which merging its LoRA would overwrite)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .base import ScoringError
from .hpsv3_weights import to_transformers5

PEFT_PREFIX = "base_model.model."
LORA_PARTS = (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B")


def read_config(root: Path) -> dict:
    """model_config.json's sections (data_config, model_config, peft_lora_config, inference_config)."""
    file = root / "model_config.json"
    if not file.is_file():
        raise ScoringError(f"reward videoalign: {str(root)!r} holds no model_config.json; set "
                           f"reward.options.videoalign.path to a VideoAlign checkpoint folder (KlingTeam/VideoReward)")
    cfg = json.loads(file.read_text())
    lacking = [k for k in ("data_config", "model_config", "peft_lora_config") if k not in cfg]
    if lacking:
        raise ScoringError(f"reward videoalign: {str(file)!r} lacks {', '.join(lacking)}; is it VideoAlign's?")
    return cfg


def checkpoint_folder(root: Path, step: int) -> Path:
    """checkpoint-<step>, or the latest one for step −1 (the released inferencer's default)."""
    found = sorted((p for p in root.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                   key=lambda p: int(p.name.split("-")[-1]))
    if not found:
        raise ScoringError(f"reward videoalign: {str(root)!r} holds no checkpoint-<step> folder")
    if step == -1:
        return found[-1]
    want = root / f"checkpoint-{step}"
    if want not in found:
        raise ScoringError(f"reward videoalign: {str(root)!r} has no checkpoint-{step} (it has "
                           f"{', '.join(p.name for p in found)}); set reward.options.videoalign.step to one, or −1")
    return want


def _layout(key: str) -> str:
    """A checkpoint key (PEFT-prefixed or not) in transformers 5's layout, without the prefix."""
    return to_transformers5(key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key)


def _reads(key: str) -> bool:
    return not key.startswith("lm_head.")


def _apply_lora(model: nn.Module, lora: dict[str, torch.Tensor], trained: dict[str, torch.Tensor],
                peft_cfg: dict, where: str) -> nn.Module:
    """`model` with the adapter and the other trained tensors loaded through PEFT, merged."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    targets = sorted({k[:k.index(part)] for k in lora for part in LORA_PARTS if part in k})
    wrapped = get_peft_model(model, LoraConfig(
        r=int(peft_cfg.get("lora_r", 16)), lora_alpha=float(peft_cfg.get("lora_alpha", 32)),
        use_rslora=bool(peft_cfg.get("use_rslora", False)), lora_dropout=0.0, bias="none",
        target_modules=targets))
    result = set_peft_model_state_dict(wrapped, {PEFT_PREFIX + k: v for k, v in lora.items()})
    stray = [k for k in result.unexpected_keys if "lora_" in k]
    _, unexpected = wrapped.load_state_dict({PEFT_PREFIX + k: v for k, v in trained.items()}, strict=False)
    if stray or unexpected:
        raise ScoringError(f"reward videoalign: {where} does not fit the base model: "
                           f"{(stray + unexpected)[:3]} name nothing in it; is base the Qwen2-VL it was tuned from?")
    return wrapped.merge_and_unload()


def load_videoalign(root: Path, cfg: dict, base: str, step: int, vocab: int, special: bool, dtype: torch.dtype):
    """(the Qwen2-VL reward model in `dtype` with its `rm_head`, the checkpoint folder read) from
    `root` (its `read_config`: `cfg`) on the base checkout's weights; `vocab`: the tokenizer's size
    with the special tokens."""
    from transformers import Qwen2VLForConditionalGeneration

    folder = checkpoint_folder(root, step)
    model = Qwen2VLForConditionalGeneration.from_pretrained(base, dtype=dtype)
    if special:
        with torch.random.fork_rng(devices=[]):  # the new rows are overwritten below; keep the caller's RNG
            model.resize_token_embeddings(vocab, mean_resizing=False)
    out = int(cfg["model_config"].get("output_dim", 1))
    model.rm_head = nn.Linear(model.config.text_config.hidden_size, out, bias=False).to(dtype)
    full = folder / "model.pth"
    if full.is_file():
        state = {_layout(k): v.to(dtype) for k, v in torch.load(full, map_location="cpu", weights_only=True).items()}
        state = {k: v for k, v in state.items() if _reads(k)}
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if _reads(k)]
        if missing or unexpected:
            raise ScoringError(f"reward videoalign: {str(full)!r} does not fit the Qwen2-VL of {base!r}: "
                               f"{len(missing)} missing (e.g. {missing[:2]}), {len(unexpected)} unexpected "
                               f"(e.g. {unexpected[:2]})")
        return model, folder
    adapter, rest = folder / "adapter_model.safetensors", folder / "non_lora_state_dict.pth"
    if not (adapter.is_file() and rest.is_file()):
        raise ScoringError(f"reward videoalign: {str(folder)!r} holds neither model.pth nor "
                           f"adapter_model.safetensors with non_lora_state_dict.pth")
    from safetensors.torch import load_file

    lora = {_layout(k): v for k, v in load_file(str(adapter)).items() if _reads(_layout(k))}
    trained = {_layout(k): v.to(dtype) for k, v in torch.load(rest, map_location="cpu", weights_only=True).items()}
    trained = {k: v for k, v in trained.items() if _reads(k)}
    if "rm_head.weight" not in trained and "rm_head.base_layer.weight" not in trained:
        raise ScoringError(f"reward videoalign: {str(rest)!r} holds no reward head (rm_head.weight)")
    if special and not any(k.startswith("model.language_model.embed_tokens.") and "lora_" not in k for k in trained):
        raise ScoringError(f"reward videoalign: {str(rest)!r} holds no trained embeddings for the reward tokens "
                           f"(model.embed_tokens.weight); without them their rows would be random")
    return _apply_lora(model, lora, trained, cfg["peft_lora_config"], repr(str(folder))), folder
