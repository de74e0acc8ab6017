"""A tiny VideoAlign checkpoint in the released layout, for tests and for trying the reward without
weights: a Qwen2-VL-Instruct base checkout whose model.safetensors is in transformers 4.45's key
layout (as the Hub's Qwen2-VL-2B-Instruct), and a VideoAlign folder trained the way its trainer
trains — the special reward tokens added, LoRA on the language model's linear layers (vision
tower, heads and embeddings excluded), the reward head, the tokens' embeddings and the vision
tower trained in full — saved as its trainer saves: model_config.json, and checkpoint-<step>/ with
PEFT's adapter_model.safetensors and non_lora_state_dict.pth (4.45 keys under PEFT's prefix)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .hpsv3_tiny import qwen2_vl_tokenizer, tiny_config, to_transformers445
from .videoalign_prompts import DETAILED, DETAILED_SPECIAL, SIMPLE, SPECIAL_TOKENS, VIDEO_SCORE

EXCLUDE = ["visual", "rm_head", "lm_head", "embed_tokens"]
#: a z-normalisation like the release's `inference_config` (its numbers are the release's own)
NORM = {"VQ_mean": 0.5, "VQ_std": 2.0, "MQ_mean": -0.25, "MQ_std": 4.0, "TA_mean": 1.0, "TA_std": 0.5}


def _prefixed(key: str) -> str:
    return "base_model.model." + to_transformers445(key[len("base_model.model."):])


def write_tiny_base(out_dir: Path, hidden: int = 32, seed: int = 0) -> Path:
    """A Qwen2-VL-Instruct checkout with weights, keys in 4.45's layout."""
    from safetensors.torch import save_file
    from transformers import Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    base = Path(out_dir) / "Qwen2-VL-2B-Instruct-tiny"
    base.mkdir(parents=True, exist_ok=True)
    tok = qwen2_vl_tokenizer(base, DETAILED_SPECIAL + DETAILED + SIMPLE + VIDEO_SCORE + " visual quality")
    cfg = tiny_config(tok, hidden)
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = True  # as Qwen2-VL-2B's
    cfg.save_pretrained(str(base))
    Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056).save_pretrained(str(base))
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg)
    state = {to_transformers445(k): v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(base / "model.safetensors"), metadata={"format": "pt"})
    return base


def _model_config(output_dim: int, max_pixels: int, lora_r: int, lora_alpha: int, norm: bool) -> dict:
    cfg = {
        "data_config": {"meta_data": "train.csv", "data_dir": "videos", "max_frame_pixels": max_pixels,
                        "num_frames": None, "fps": 2.0, "eval_dim": ["VQ", "MQ", "TA"],
                        "prompt_template_type": "detailed_special", "sample_type": "uniform"},
        "model_config": {"model_name_or_path": "Qwen/Qwen2-VL-2B-Instruct", "output_dim": output_dim,
                         "use_special_tokens": True, "reward_token": "special", "torch_dtype": "bfloat16"},
        "peft_lora_config": {"lora_enable": True, "vision_lora": False, "lora_r": lora_r, "lora_alpha": lora_alpha,
                             "lora_dropout": 0.05, "lora_namespan_exclude": EXCLUDE, "use_rslora": False,
                             "lora_task_type": "CAUSAL_LM", "num_lora_modules": -1},
    }
    if norm:
        cfg["inference_config"] = dict(NORM)
    return cfg


def lora_targets(model: nn.Module, exclude: list[str]) -> list[str]:
    """VideoAlign's `find_target_linear_names`: every Linear and Embedding whose name holds no
    excluded word."""
    return [n for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Embedding)) and not any(x in n for x in exclude)]


def write_tiny_videoalign(out_dir: Path, hidden: int = 32, seed: int = 0, step: int = 100, output_dim: int = 3,
                          max_pixels: int = 448 * 448, lora_r: int = 4, lora_alpha: int = 8,
                          norm: bool = True) -> tuple[Path, Path]:
    """(the VideoAlign folder, the base checkout) under `out_dir`."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    out_dir = Path(out_dir)
    base = write_tiny_base(out_dir, hidden, seed)
    tok = AutoTokenizer.from_pretrained(str(base))
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(base), dtype=torch.float32)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.rm_head = nn.Linear(hidden, output_dim, bias=False)
    peft = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.05, bias="none",
                                            target_modules=lora_targets(model, EXCLUDE)))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # "training": every adapter and every fully trained tensor moves
        for name, p in peft.named_parameters():
            inner = name[len("base_model.model."):]
            trained = "lora_" in name or inner.startswith(("rm_head", "model.visual.blocks", "model.language_model."
                                                                                             "embed_tokens"))
            p.requires_grad_(trained)
            if trained:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    root = out_dir / "VideoReward-tiny"
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    (root / "model_config.json").write_text(json.dumps(_model_config(output_dim, max_pixels, lora_r, lora_alpha,
                                                                     norm), indent=4))
    adapter = {_prefixed(k): v.contiguous() for k, v in get_peft_model_state_dict(peft).items()}
    save_file(adapter, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    rest = {_prefixed(k): v.detach().clone() for k, v in peft.named_parameters()
            if v.requires_grad and "lora_" not in k}
    torch.save(rest, folder / "non_lora_state_dict.pth")
    return root, base
