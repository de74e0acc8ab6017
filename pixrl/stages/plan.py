"""Pure functions of the run seed and the stored advantages: per-sample seeds and the training
micro-batch plan. Replay, resume and forks recompute them and get the same answer."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def seed_of(run_seed: int, *parts: int) -> int:
    """A 63-bit seed from (run seed, iteration, role, prompt slot, group member, …)."""
    return int(np.random.SeedSequence([run_seed, *parts]).generate_state(1, dtype=np.uint64)[0] >> 1)


@dataclass
class BatchPlan:
    """Training micro-batches (sample ids) grouped by optimizer step, formed by replay."""

    steps: list[list[list[str]]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"steps": self.steps}


def make_plan(sample_ids: list[str], keep: np.ndarray, micro_batch: int, optimizer_steps: int,
              segments: np.ndarray | None = None, passes: int = 1) -> BatchPlan:
    """Micro-batches in rollout order (samples the algorithm does not train on dropped), split
    into contiguous optimizer-step groups. `segments` (per sample, e.g. its dynamic-sampling
    round): no micro-batch spans two — each round's prompts were encoded as one set at rollout,
    and replay must condition on those very encodings for the ratio to be exactly 1. `passes`:
    that many rounds over the micro-batches, each its own optimizer steps (Algorithm.passes)."""
    if segments is None:
        segments = np.zeros(len(sample_ids), dtype=np.int64)
    micro = []
    for seg in dict.fromkeys(np.asarray(segments).tolist()):  # in order of first appearance
        kept = [sid for sid, k, s in zip(sample_ids, keep, segments) if k and s == seg]
        micro += [kept[i:i + micro_batch] for i in range(0, len(kept), micro_batch)]
    if not micro:
        return BatchPlan([])
    n_opt = min(optimizer_steps, len(micro))
    bounds = np.linspace(0, len(micro), n_opt + 1).round().astype(int)
    return BatchPlan([micro[bounds[i]:bounds[i + 1]] for i in range(n_opt)] * passes)
