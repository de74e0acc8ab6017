"""The Engine protocol: compute only. An engine turns (policy version, prompts, seeds) into a
rollout batch, latents into images, images into rewards, and stored batches into new trainable
state. It never touches Prefect, MLflow or the stage records, and never decides whether work is
needed: the stage layer (pixrl.stages) asks the stores, calls the engine, then records and
commits — identically for every engine (`run.engine`: local, or ray — engines/ray_engine.py).

An engine whose workers can write the trajectory table themselves also offers
`rollout_to_store(policy, prompts, seeds, recipe, noise_seeds, sink) -> (fragments, schema,
seconds)`: the same rows as `rollout`, written as uncommitted Lance fragments through the stage's
`RowSink` (artifacts/rollout_rows.py); the stage layer then commits them as one version. Such an
engine may also offer `decode_to_store(reads, field) -> (column files, seconds)` (its workers
decode whole fragments of the iteration and write the image columns; the stage commits them as
one version) and `score_from_store(rows, iteration) -> (rewards, seconds)` (its workers read the
images, prompts and metadata themselves): artifacts/column_writes.py.

An in-process engine's `rollout` also takes `on_chunk(start, stop, decode_input)`, called as
each micro-batch finishes (reward.overlap: the stage layer decodes and scores it in a background
thread while the next one generates; stages/overlap.py).

Policies travel as `PolicySource` (a local checkpoint directory + its id, or the base weights),
so an engine loads exactly the version a stage names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..algorithms.sampling import SamplerRecipe
from ..artifacts.batch import RolloutBatch


@dataclass(frozen=True)
class PolicySource:
    """Where a policy version's weights are: None = the base model's."""

    checkpoint_dir: Path | None = None
    checkpoint_id: str | None = None
    with_optimizer: bool = True  # False: start these weights with fresh optimizer moments (DPO's init)
    ema: bool = False  # the checkpoint's weight average (algorithm.ema), where a version is evaluated


@dataclass
class TrainResult:
    """The new trainable state after an update (the stage layer writes the checkpoint)."""

    weights: dict
    optimizer: dict
    metrics: dict[str, float]  # aggregated over the update
    history: list[dict[str, float]]  # per optimizer step: mean of its terms' metrics, grad_norm
    ema: tuple[dict, int] | None = None  # algorithm.ema: (the weight average, the run's optimizer steps it saw)


class Engine(Protocol):
    def describe(self) -> dict:
        """Family facts the stage layer records: name, semantics, latent shape, recipe extras."""

    def rollout(self, policy: PolicySource, prompts: list[str], seeds: list[int],
                recipe: SamplerRecipe, noise_seeds: list[int] | None = None,
                images: list[bytes | None] | None = None) -> tuple[RolloutBatch, float]:
        """One trajectory per (prompt, seed), in order; and the compute seconds. `images`: each
        prompt's source image (an editing family; passed only when the dataset has them). `noise_seeds`
        (recipe.shared_noise): each row's initial latent comes from its noise seed instead; the
        stored transitions include their means when the algorithm needs them; an algorithm with a
        separate sampling policy (DiffusionNFT) samples with the weights in that version's state."""

    def decode(self, final_latents: np.ndarray, prompts: list[str] | None = None) -> np.ndarray:
        """uint8 images [B, H, W, 3] (video [B, F, H, W, 3]); `prompts`: the rows' prompts, which a
        family whose decoder reads them needs (models/base.decode_images)."""

    def soundtracks(self, final_latents: np.ndarray) -> list[bytes] | None:
        """Each clip's soundtrack (16-bit WAV) for a family whose clips have sound; None otherwise."""

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict],
              sample_ids: list[str]) -> dict[str, np.ndarray]:
        """{'reward': total, '<name>': component, …}; raises ScoringError (never zeroes)."""

    def train(self, policy: PolicySource, batch: RolloutBatch, plan: list[list[list[int]]],
              recipe: SamplerRecipe | None, seed: int = 0, reference: PolicySource | None = None,
              prompt_sets: np.ndarray | None = None, stored: dict[str, PolicySource] | None = None) -> TrainResult:
        """Optimizer steps from `policy` (weights + optimizer state) over the plan's micro-batches
        (row positions in `batch`, grouped per optimizer step), with the configured algorithm's
        losses. `seed` seeds the update's own randomness; `reference`: the KL/DPO reference
        (None = the base model); `prompt_sets`: per row, which set of prompts the rollout
        encoded together (dynamic sampling's rounds; None: one set); `stored`: the checkpoints of
        the algorithm's stored policies (`Algorithm.stored_policies`: DiffusionOPD's teacher)."""

    def mark(self, checkpoint_id: str) -> None:
        """The engine's in-memory state now equals this (just committed) checkpoint."""

    def invalidate(self) -> None:
        """The in-memory state matches no checkpoint (an update failed or was a replay)."""

    def evaluate(self, policy: PolicySource, dataset: str, split: str, per_category: int) -> dict:
        """The dataset's registered evaluator on `policy` (held-out accuracy and per category)."""


def build_engine(cfg) -> Engine:
    """The engine `run.engine` names, for this process."""
    name = cfg.run.engine
    if name == "local":
        from .local import LocalEngine

        return LocalEngine(cfg)
    if name == "ray":
        from .ray_engine import RayEngine

        return RayEngine(cfg)
    raise ValueError(f"run.engine={name!r} is not available; engines: local, ray")
