"""What an update's backward keeps in memory at a family's real widths, measured on CPU before a
GPU lease is spent: the bytes autograd saves from one forward of the trained module (as the GPU
smoke trains it: LoRA or full, guidance rows included), with and without
`model.gradient_checkpointing`, at 1 and 2 blocks and one sample (CFG's negative rows when the
smoke guides with CFG) — then extrapolated linearly to
the smoke's depth, the real depth and the micro-batch.

Saved bytes grow by the same amount with every block (the blocks of a DiT are alike; FLUX's `layers`
unit is 1 double + 2 single blocks, as `real_shapes.py` shrinks it) and with every sample, so two
depths at one sample give the slope. With checkpointing a block keeps only its inputs, and its
backward recomputes one block at a time: the peak is the saved bytes plus one block's.

    python benchmarks/activation_memory.py --family wan [--micro-batch 4] [--resolution 512]

Prints one JSON line per family. Weights, gradients and optimizer state come on top (the smoke's
LoRA: the base weights in bf16); the figures are about activations, the part that grows with the
micro-batch and the clip.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_smoke import FAMILY_OVERRIDES, GC, VARIANTS, build_model  # noqa: E402

PROMPT = "a photo of a red circle above two blue squares"
REAL_DEPTH = {"sd3": 24, "flux1": 19, "flux2": 8, "qwen_image": 60, "sana": 20, "wan": 30, "wan_a14b": 40,
              "janus_pro": 24}
SMOKE_DEPTH = {"flux1": 8, "flux2": 2, "qwen_image": 12, "wan_a14b": 8}  # gpu_checks.py's --layers
GIB = 2 ** 30


def trained_forward(policy, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """The trained module's forward as the update runs it, at the config's guidance scale: the
    velocity (with a negative-prompt batch under CFG, the scale as an input when embedded) for
    denoise families, the teacher-forced image-token logits for token families (with CFG rows above
    1 where the family guides its logits: Janus)."""
    from pixrl.models.base import uses_negative_prompt

    fam, scale = policy.family, policy.cfg.sampling.guidance_scale
    g = torch.Generator().manual_seed(seed)
    if fam.semantics.step.value == "token":
        cond = fam.encode_prompts([PROMPT] * batch)
        codes = fam.transformer.config.vq_config.num_embeddings
        tokens = torch.randint(0, codes, (batch, fam.image_token_count()), generator=g)
        return fam.sequence_logits(cond, tokens.to(fam.device), guided=scale > 1 and fam.guidance == "logits")
    x = torch.randn(batch, *fam.latent_shape(), generator=g).to(fam.device, fam.dtype)  # as the sampler feeds it
    _, timesteps = fam.schedule(4)
    neg = fam.encode_negative("").expand(batch) if uses_negative_prompt(fam, scale) else None
    return fam.velocity(x, timesteps[1:2], fam.encode_prompts([PROMPT] * batch), scale, neg)


def saved_bytes(policy, batch: int = 1) -> int:
    """Bytes of the tensors autograd keeps for the backward of one forward (parameters and
    buffers excluded: they are there anyway). A checkpointed block's own store of its inputs is
    not seen by an outer saved-tensor hook, so those inputs are counted at the block's entry."""
    from pixrl.engines.fsdp import blocks

    params = {p.data_ptr() for p in policy.module.parameters()} | {b.data_ptr() for b in policy.module.buffers()}
    seen: set[int] = set()
    total = 0

    def count(t) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.data_ptr() not in params | seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    def entry(module, args, kwargs):
        if getattr(module, "_pixrl_checkpointed", False) and torch.is_grad_enabled():
            for a in (*args, *kwargs.values()):
                for t in (a if isinstance(a, (tuple, list)) else (a,)):
                    count(t)

    def pack(t: torch.Tensor):
        count(t)
        return t

    hooks = [u.register_forward_pre_hook(entry, with_kwargs=True) for u in blocks(policy.module)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = trained_forward(policy, batch)
    finally:
        for h in hooks:
            h.remove()
    del out
    return total


def measure(family: str, resolution: int, work: Path) -> dict:
    """Saved bytes at 1 and 2 blocks, without and with checkpointing, one sample."""
    from pixrl.config.loader import load_config
    from pixrl.engines.activation_checkpointing import enable_activation_checkpointing
    from pixrl.engines.policy import TrainablePolicy

    out: dict = {}
    for layers in (1, 2):
        path = build_model(work / f"model-{layers}", False, resolution, family, layers, "cpu")
        overrides = [o for o in FAMILY_OVERRIDES[family](False) if o != GC]
        res = None if family == "janus_pro" else resolution
        cfg = load_config(None, [f"model.family={VARIANTS.get(family, (family,))[0]}", f"model.path={path}",
                                 "model.device=cpu",
                                 "model.dtype=bfloat16", *overrides, f"model.resolution={'null' if res is None else res}"])
        policy = TrainablePolicy(cfg)
        plain = saved_bytes(policy)
        enable_activation_checkpointing(policy.family, policy.module)
        out[layers] = {"plain": plain, "checkpointed": saved_bytes(policy),
                       "block_params": sum(p.numel() for p in policy.module.parameters())}
        del policy
    return out


def extrapolate(family: str, m: dict, micro_batch: int) -> dict:
    per_block = m[2]["plain"] - m[1]["plain"]
    per_block_ckpt = m[2]["checkpointed"] - m[1]["checkpointed"]

    def at(depth: int) -> dict:
        plain = (m[1]["plain"] + (depth - 1) * per_block) * micro_batch
        ckpt = (m[1]["checkpointed"] + (depth - 1) * per_block_ckpt + per_block) * micro_batch
        params = m[1]["block_params"] + (depth - 1) * (m[2]["block_params"] - m[1]["block_params"])
        return {"depth": depth, "activations_gib": round(plain / GIB, 2),
                "activations_checkpointed_gib": round(ckpt / GIB, 2), "trained_module_params_b": round(params / 1e9, 2)}

    res = {"family": family, "micro_batch": micro_batch, "per_block_gib_per_sample": round(per_block / GIB, 3),
           "per_block_checkpointed_gib_per_sample": round(per_block_ckpt / GIB, 4), "real": at(REAL_DEPTH[family])}
    if family in SMOKE_DEPTH:
        res["smoke"] = at(SMOKE_DEPTH[family])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", action="append", choices=sorted(FAMILY_OVERRIDES), required=True)
    ap.add_argument("--micro-batch", type=int, default=4, help="samples per update forward (gpu_smoke's default)")
    ap.add_argument("--resolution", type=int, default=512)
    args = ap.parse_args()
    from pixrl.config.environment import apply_defaults

    apply_defaults()
    for family in args.family:
        with tempfile.TemporaryDirectory(prefix=f"pixrl-actmem-{family}-") as work:
            m = measure(family, args.resolution, Path(work))
        print(json.dumps({**extrapolate(family, m, args.micro_batch), "measured_bytes": m}), flush=True)


if __name__ == "__main__":
    main()
