"""Janus-Pro's language model as a plain Llama checkout, for a text server (vLLM) that samples the
chain of thought (T2I-R1) for the policy.

Janus-Pro's decoder is a LlamaModel and its text head a Linear: exported under
LlamaForCausalLM's names (`model.language_model.X` → `model.X`, `lm_head`, written apart from the embedding it is tied
to), with the checkpoint's
text config and tokenizer, they are a checkout any Llama server loads. `text_weights` gives the
current in-memory weights — LoRA adapters merged (W + ΔW, peft's own delta) — so a server can be
moved to exactly the policy version a rollout names.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

LM_PREFIX = "model.language_model."
WEIGHTS_FILE = "model.safetensors"


def _merged(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s weights with every LoRA layer folded into its base weight (adapter tensors dropped)."""
    out = {k: v for k, v in module.state_dict().items() if "lora_" not in k}
    for name, sub in module.named_modules():
        if hasattr(sub, "base_layer") and hasattr(sub, "get_delta_weight"):
            w = sub.base_layer.weight.detach()
            for adapter in getattr(sub, "active_adapters", []):
                if adapter in getattr(sub, "lora_A", {}):
                    w = w + sub.get_delta_weight(adapter).to(w.dtype)
            out.pop(f"{name}.base_layer.weight")
            out[f"{name}.weight"] = w
            if f"{name}.base_layer.bias" in out:
                out[f"{name}.bias"] = out.pop(f"{name}.base_layer.bias")
    return out


def text_weights(family) -> dict[str, torch.Tensor]:
    """The language model and text head, LoRA merged, under LlamaForCausalLM's names (on host)."""
    state = _merged(family.model)
    out = {"model." + k[len(LM_PREFIX):]: v for k, v in state.items() if k.startswith(LM_PREFIX)}
    out["lm_head.weight"] = family.model.lm_head.weight  # stored apart even when tied (below)
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in out.items()}


def text_config(family) -> dict:
    """The checkout's text config as a LlamaForCausalLM config.json."""
    cfg = family.model.config.text_config.to_dict()
    # untied even though Janus-Pro ties its head to the embedding: vLLM's CPU build keeps a
    # repacked copy of a tied head that reload_weights does not refresh (measured: a full
    # fine-tune's changed embedding left the server 0.02–0.05 nats off the policy)
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False,
               torch_dtype=str(family.dtype).removeprefix("torch."))
    return cfg


def write_text_weights(family, out_dir: Path) -> Path:
    """The current text weights as `out_dir/model.safetensors`, written whole or not at all."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(text_weights(family), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def write_text_checkout(family, out_dir: Path) -> Path:
    """A LlamaForCausalLM checkout of the family's language model: config, tokenizer, weights."""
    out_dir = write_text_weights(family, Path(out_dir))
    (out_dir / "config.json").write_text(json.dumps(text_config(family), indent=2))
    family.tokenizer.save_pretrained(str(out_dir))
    gen = {"bos_token_id": family.tokenizer.bos_token_id, "eos_token_id": family.eos_id,
           "pad_token_id": family.pad_id, "do_sample": True}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out_dir
