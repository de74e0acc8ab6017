"""A guider's state carried along one trajectory: the seam for guidance that is not a function of
the step alone. HunyuanImage-2.1's adaptive projected guidance keeps a momentum buffer — the
running sum m_k = (c_k − u_k) + μ·m_{k−1} of the conditional minus unconditional velocities — so
the guided velocity of step k depends on every earlier step of its trajectory.

The sampler treats the buffer as part of the state: each rollout carries a `GuidanceMemory`
through its steps (the family reads m_{k−1} and leaves m_k), and every stored transition keeps
the m_{k−1} it was sampled with (the `guidance_memory` column). Replay hands that stored value
back, so a transition's log-prob is recomputed exactly (ratio 1 before an update) and the
gradient flows through the step's own velocities, the memory held fixed as an observation — as
the latent x_k is. A family declares `guidance_memory = True` (for its configuration) to be given
one (and the grid step); every other family is called as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GuidanceMemory:
    """The memory before the next step: None until a guided step wrote one (the buffer's 0)."""

    value: torch.Tensor | None = None

    def snapshot(self, like: torch.Tensor) -> torch.Tensor:
        """m_{k−1} as a transition stores it: zeros before the first guided step."""
        return torch.zeros_like(like) if self.value is None else self.value

    def select(self, idx) -> "GuidanceMemory":
        return GuidanceMemory(None if self.value is None else self.value[idx])


def memory_for(policy, recipe) -> GuidanceMemory | None:
    """A fresh memory for a rollout of `policy` with `recipe`, or None where guidance keeps none
    (another family, a guider without momentum, or no guidance: a scale of 1)."""
    keeps = getattr(policy, "guidance_memory", False) and recipe.guidance_scale > 1
    return GuidanceMemory() if keeps else None


def memory_kwargs(policy, memory: GuidanceMemory | None, k: int) -> dict:
    """What a family with a stateful guider (one that declares `guidance_memory`, true or not for
    its configuration) is given beside the usual arguments: the memory and the grid step, which its
    guider's phases follow; nothing for every other family."""
    return {"memory": memory, "step": k} if hasattr(policy, "guidance_memory") else {}
