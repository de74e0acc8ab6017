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

With `run.staleness_weight_cap` C the algorithm is also given each recomputed row's behaviour
weights [S] (`Algorithm.set_behaviour_weights`, by sample id): each stored transition's
min(exp(log π_prox − log π_behav), C), the truncated importance weight of decoupled
PPO (Hilton et al. 2022) that carries the update's surrogate, taken on the proximal policy's
samples, back to the rows the behaviour policy drew. Per transition and per stored value, as the
ratio itself is (flow_grpo's log-probs are means over the latent's elements).
"""

from __future__ import annotations

import numpy as np
import torch

from ..artifacts.batch import RolloutBatch
from ..stages.plan import seed_of


def proximal_batch(algo, batch: RolloutBatch, plan: list[list[list[int]]], replay_policy, coll, device,
                   seed: int, weight_cap: float | None = None) -> tuple[RolloutBatch, dict[str, list[float]]]:
    """`batch` with the algorithm's old-policy columns recomputed under the loaded weights for
    every row this rank trains (and, with `weight_cap`, the behaviour weights), and the drift
    metrics; `batch` itself when the algorithm's loss takes no ratio to the sampling policy."""
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
    rows = sorted(done)
    drift = _drift(batch["log_probs"], columns["log_probs"], rows)
    if weight_cap is not None:
        weights = behaviour_weights(batch["log_probs"], columns["log_probs"], weight_cap)
        algo.set_behaviour_weights({batch["sample_id"][r]: weights[r] for r in rows})
        drift.update(_weight_metrics(batch["log_probs"], columns["log_probs"], weights, rows, weight_cap))
    return batch.with_columns(**columns), drift


def behaviour_weights(behaviour: np.ndarray, proximal: np.ndarray, cap: float) -> np.ndarray:
    """min(π_prox/π_behav, cap) per stored value (float32)."""
    log_ratio = proximal.astype(np.float64) - behaviour.astype(np.float64)
    return np.minimum(np.exp(np.minimum(log_ratio, 30.0)), cap).astype(np.float32)


def _weight_metrics(behaviour: np.ndarray, proximal: np.ndarray, weights: np.ndarray, rows: list[int],
                    cap: float) -> dict[str, list[float]]:
    """The weights' mean and the fraction the cap truncated, on the recomputed rows."""
    if not rows:
        return {}
    capped = (proximal[rows].astype(np.float64) - behaviour[rows].astype(np.float64)) > np.log(cap)
    return {"off_policy/weight_mean": [float(weights[rows].mean())],
            "off_policy/weight_capped_frac": [float(capped.mean())]}


def _drift(behaviour: np.ndarray, proximal: np.ndarray, rows: list[int]) -> dict[str, list[float]]:
    """How far the sampling policy's log-probs are from the update's start on the recomputed rows:
    mean |Δ log π| and the largest importance ratio π_prox / π_behav (per stored value)."""
    if not rows:
        return {}
    delta = proximal[rows].astype(np.float64) - behaviour[rows].astype(np.float64)
    return {"off_policy/log_ratio_abs_mean": [float(np.abs(delta).mean())],
            "off_policy/ratio_max": [float(np.exp(min(delta.max(), 30.0)))],
            "off_policy/ratio_min": [float(np.exp(max(delta.min(), -30.0)))]}
