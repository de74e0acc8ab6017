"""Activation (gradient) checkpointing for the trained module: each block keeps only its inputs
in the forward and recomputes its activations in the backward. An update's memory is then about
one block's activations plus every block's input, instead of every block's activations — what a
video DiT needs (Wan at 33 frames of 512²: 4 clips × 9,216 tokens, with CFG, ran out of an H200's
140 GiB in the update without it; docs/runs/gpu_smoke).

One mechanism for every family, diffusers and transformers alike: the block's class is swapped
for a subclass whose `forward` goes through `torch.utils.checkpoint` (non-reentrant, the RNG state
preserved) whenever autograd records. Under `no_grad` — rollouts, the frozen reference, replay
of old log-probs — a block runs as before. A subclass rather than a patched bound method, so a
deep copy of the module (the KL reference) recomputes its own weights, and FSDP's own subclass
(`fully_shard`) keeps its gathering hooks outside the recomputed forward. The recompute runs the
same operations on the same inputs, so losses and gradients are unchanged (tests compare them
bit for bit)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .fsdp import blocks

_CLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    if cls not in _CLASSES:
        def forward(self, *args, **kwargs):
            inner = super(sub, self).forward
            if torch.is_grad_enabled():
                return checkpoint(inner, *args, use_reentrant=False, **kwargs)
            return inner(*args, **kwargs)

        sub = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "_pixrl_checkpointed": True})
        _CLASSES[cls] = sub
    return _CLASSES[cls]


def enable_activation_checkpointing(family, module: torch.nn.Module) -> int:
    """Checkpoint each block of `module` (idempotent); returns how many blocks are checkpointed."""
    units = blocks(module)  # a DiT's blocks, a language model's layers: the units FSDP shards
    if not units:
        raise ValueError(f"model.gradient_checkpointing: the {family.name} family's trained module "
                         f"({type(module).__name__}) has no blocks to checkpoint; set it to false")
    for unit in units:
        if not getattr(unit, "_pixrl_checkpointed", False):
            unit.__class__ = _checkpointed_class(type(unit))
    return len(units)
