"""What a frozen policy beside the trained one costs: DiffusionNFT's sampler, AWM's anchor and the
update's starting weights, DGPO's EMA reference, an explicit KL reference. Each is a
`frozen_copy` of the trained module (engines/policy.py) that owns only the trained tensors and
shares the rest; under LoRA that is the adapter alone. Figures for the real transformers
(diffusers' classes at the published configs, built on the meta device: no memory, the code
path's own tensors counted) against a whole copy, at bf16 and LoRA rank 32 and 64 on each
family's LoRA targets:

    python benchmarks/frozen_copies.py            # the table (seconds)
    python benchmarks/frozen_copies.py --measure  # + resident memory of both copies of SD3.5-M (CPU, ~10 GB)

Prints one JSON line per model.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pixrl.engines.adapters import add_lora  # noqa: E402
from pixrl.engines.policy import frozen_copy  # noqa: E402
from pixrl.models.registry import get_family  # noqa: E402

GIB = 2 ** 30


def sd35_medium():
    from diffusers import SD3Transformer2DModel
    return "sd3", SD3Transformer2DModel(
        sample_size=64, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
        pos_embed_max_size=384, qk_norm="rms_norm", dual_attention_layers=tuple(range(13)))


def flux1_dev():
    from diffusers import FluxTransformer2DModel
    return "flux1", FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56))


def qwen_image():
    from diffusers import QwenImageTransformer2DModel
    return "qwen_image", QwenImageTransformer2DModel(num_layers=60)


def wan21_14b():
    from diffusers import WanTransformer3DModel
    return "wan", WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
        text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40)


MODELS = {"SD3.5-Medium": sd35_medium, "FLUX.1-dev": flux1_dev, "Qwen-Image": qwen_image,
          "Wan2.1-T2V-14B": wan21_14b}


def with_lora(build, rank: int, device: str):
    from peft import LoraConfig

    with torch.device(device):
        family, module = build()
        module = module.to(torch.bfloat16)
        add_lora(module, LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                    target_modules=list(get_family(family).lora_targets)))
    module.requires_grad_(False)
    trained = [p for n, p in module.named_parameters() if "lora_" in n]
    for p in trained:
        p.requires_grad_(True)
    return module, trained


def owned_bytes(held: torch.nn.Module, module: torch.nn.Module) -> int:
    live = {id(p) for p in module.parameters()}
    return sum(p.numel() * p.element_size() for p in held.parameters() if id(p) not in live)


def table(rank: int) -> None:
    for name, build in MODELS.items():
        module, trained = with_lora(build, rank, "meta")
        whole = sum(p.numel() * p.element_size() for p in module.parameters())
        shared = owned_bytes(frozen_copy(module, trained), module)
        print(json.dumps({"model": name, "lora_rank": rank, "params_b": round(sum(p.numel() for p in module.parameters()) / 1e9, 2),
                          "whole_copy_gib": round(whole / GIB, 2), "frozen_copy_gib": round(shared / GIB, 3),
                          "ratio": round(whole / shared)}))


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / GIB


def measure(rank: int) -> None:
    """Resident memory each kind of copy adds, SD3.5-Medium's transformer in bf16 on CPU."""
    module, trained = with_lora(sd35_medium, rank, "cpu")
    start = rss_gib()
    held = frozen_copy(module, trained)
    after_frozen = rss_gib()
    whole = copy.deepcopy(module)
    after_whole = rss_gib()
    del held, whole
    print(json.dumps({"model": "SD3.5-Medium", "lora_rank": rank, "measured": "resident memory added",
                      "frozen_copy_gib": round(after_frozen - start, 3), "whole_copy_gib": round(after_whole - after_frozen, 2)}))


def main() -> None:
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # the bf16 cast's notice, once per model
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", action="store_true", help="also measure SD3.5-M's copies in resident memory")
    args = ap.parse_args()
    for rank in (32, 64):
        table(rank)
    if args.measure:
        measure(32)


if __name__ == "__main__":
    main()
