"""The algorithm's stored policies (`Algorithm.stored_policies`: DiffusionOPD's teacher) as an
engine holds them: each registered version's trained tensors, loaded once per checkpoint, checked
against the tensors this policy trains (a LoRA teacher of another rank or target set, or a full
fine-tune's weights beside a LoRA student, would load into the wrong places or fail mid-update)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..artifacts.checkpoints import check_trained_part, load_weights
from .base import PolicySource


def check_same_tensors(weights: dict[str, torch.Tensor], trainable: dict[str, torch.Tensor], what: str) -> None:
    """`weights` are of the tensors this policy trains, by name and shape, or a ValueError naming
    the difference and the fix."""
    mine = {k: tuple(v.shape) for k, v in trainable.items()}
    theirs = {k: tuple(v.shape) for k, v in weights.items()}
    if mine == theirs:
        return
    absent, other = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    reshaped = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
    parts = [f"{len(absent)} of this policy's {len(mine)} trained tensors absent (e.g. {absent[0]})" if absent else "",
             f"{len(other)} it does not train (e.g. {other[0]})" if other else "",
             f"{len(reshaped)} of other shapes (e.g. {reshaped[0]}: {theirs[reshaped[0]]} vs {mine[reshaped[0]]})"
             if reshaped else ""]
    raise ValueError(f"{what} holds other trained tensors than this run's policy: "
                     f"{'; '.join(p for p in parts if p)} — it must have been trained with this run's "
                     f"algorithm.lora settings (enabled, rank, target modules) and model.expert")


class StoredPolicies:
    """Loaded stored policies by slot, reloaded only when a slot's checkpoint changes."""

    def __init__(self):
        self._held: dict[str, tuple[tuple, dict[str, torch.Tensor]]] = {}

    def give(self, algorithm, stored: dict[str, PolicySource], trainable: dict[str, torch.Tensor],
             expert: str | None) -> None:
        """Load each slot's checkpoint (once) and hand its weights to the algorithm."""
        wanted = algorithm.stored_policies()
        if set(stored) != set(wanted):
            raise ValueError(f"algorithm {algorithm.name!r} reads the stored policies {sorted(wanted)}; the update "
                             f"was given {sorted(stored)}")
        for name, src in stored.items():
            if src.checkpoint_dir is None:
                raise ValueError(f"stored policy {name!r} ({wanted[name]}) has no checkpoint: the base weights are "
                                 f"not a stored policy — name a trained version")
            key = (str(Path(src.checkpoint_dir).resolve()), src.checkpoint_id)
            if name not in self._held or self._held[name][0] != key:
                check_trained_part(src.checkpoint_dir, expert)
                weights = load_weights(src.checkpoint_dir)
                check_same_tensors(weights, trainable, f"{name} {wanted[name]}")
                self._held[name] = (key, weights)
            algorithm.use_stored_policy(name, self._held[name][1])
