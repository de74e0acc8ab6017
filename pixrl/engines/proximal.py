"""The old log-probs of an update whose rows an older policy sampled (`run.staleness` > 0).

Flow-GRPO's clip range (1e-4) bounds the ratio π_θ / π_old around 1; with rows sampled N
updates ago, the stored (behaviour) log-probs already differ from the update's starting weights
by N updates' worth, so nearly every ratio would start outside the range and be clipped. Before
the first optimizer step each of this rank's micro-batches is replayed once, without gradients,
under the update's starting weights, and the algorithm's old-policy columns are replaced by the
result: the proximal policy of decoupled PPO, and the `compute_log_prob` pass that verl's and
MM-GRPO's one-step-off trainers make before their updates. The ratio of the first optimizer step
is then exactly 1, as on-policy, and the clip bounds the move from the update's start.

A row is recomputed in the first micro-batch that holds it (the loss's own geometry: a batched
forward's bits depend on its batch); the behaviour log-probs stay in the trajectory table, and
how far the two are apart is logged (`off_policy/*`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..artifacts.batch import RolloutBatch
from ..stages.plan import seed_of


def proximal_batch(algo, batch: RolloutBatch, plan: list[list[list[int]]], replay_policy, coll, device,
                   seed: int) -> tuple[RolloutBatch, dict[str, list[float]]]:
    """`batch` with the algorithm's old-policy columns recomputed under the loaded weights for
    every row this rank trains, and the drift metrics; `batch` itself when the algorithm's loss
    takes no ratio to the sampling policy."""
    columns: dict[str, np.ndarray] = {}
    done: set[int] = set()
    for opt_step, step_batches in enumerate(plan):
        for j, mb, weight in coll.share(step_batches):  # every rank the same calls (FSDP's lockstep)
            gen = torch.Generator(device=device).manual_seed(seed_of(seed, opt_step, j, 1))  # not the loss's
            got = algo.proximal_columns(batch.select(mb), replay_policy(mb, gen))
            if not got:
                return batch, {}
            if weight != 1.0:  # a sharded rank's padding: another rank's rows
                continue
            for name, values in got.items():
                target = columns.setdefault(name, np.array(batch[name], copy=True))
                for r, row in enumerate(mb):
                    if row not in done:
                        target[row] = values[r]
            done.update(mb)
    if not columns:
        return batch, {}
    return batch.with_columns(**columns), _drift(batch["log_probs"], columns["log_probs"], sorted(done))


def _drift(behaviour: np.ndarray, proximal: np.ndarray, rows: list[int]) -> dict[str, list[float]]:
    """How far the sampling policy's log-probs are from the update's start on the recomputed rows:
    mean |Δ log π| and the largest importance ratio π_prox / π_behav (per stored value)."""
    if not rows:
        return {}
    delta = proximal[rows].astype(np.float64) - behaviour[rows].astype(np.float64)
    return {"off_policy/log_ratio_abs_mean": [float(np.abs(delta).mean())],
            "off_policy/ratio_max": [float(np.exp(min(delta.max(), 30.0)))],
            "off_policy/ratio_min": [float(np.exp(max(delta.min(), -30.0)))]}
