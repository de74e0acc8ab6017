"""The engine calls of one generate stage: one per part of the iteration's rollout.

An algorithm may sample an iteration in parts (`Algorithm.rollout_parts`), each over the same
prompts with its own recipe; each part is one engine call over its contiguous rows, so its
micro-batches, prompt encodings and noise are exactly what a single-part rollout of those rows
would have (and what the update replays, one part at a time). With one part this is the one
call the stage always made.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..artifacts.batch import RolloutBatch
from ..artifacts.rollout_rows import RowSink
from ..engines.base import PolicySource


@dataclass
class RolloutCalls:
    source: PolicySource
    prompts: list[str]  # every row's, in generation order
    seeds: list[int]
    noise_seeds: list[int] | None
    images: list[bytes | None] | None
    parts: list[tuple]  # (recipe, first row, end row)

    def _kwargs(self, lo: int, hi: int) -> dict:
        kw = {"noise_seeds": self.noise_seeds[lo:hi] if self.noise_seeds else None}
        if self.images is not None:
            kw["images"] = self.images[lo:hi]
        return kw

    def rollout(self, engine, on_chunk=None) -> tuple[RolloutBatch, float]:
        """Every part in this process, concatenated in row order; `on_chunk(lo, hi, data)` gets
        row numbers of the whole stage."""
        batches, seconds = [], 0.0
        for recipe, lo, hi in self.parts:
            kw = self._kwargs(lo, hi)
            if on_chunk is not None:
                kw["on_chunk"] = lambda a, b, data, lo=lo: on_chunk(a + lo, b + lo, data)
            batch, took = engine.rollout(self.source, self.prompts[lo:hi], self.seeds[lo:hi], recipe, **kw)
            batches.append(batch)
            seconds += took
        return (batches[0] if len(batches) == 1 else RolloutBatch.concat(batches)), seconds

    def to_store(self, rollout_to_store, uri: str, columns: dict, decoded: tuple[str, ...], step: str,
                 create: bool) -> tuple[list, object, float]:
        """Every part written by the engine's workers as uncommitted fragments (one commit later)."""
        fragments, schema, seconds = [], None, 0.0
        for recipe, lo, hi in self.parts:
            sink = RowSink(uri, {k: v[lo:hi] for k, v in columns.items()}, decoded, step, create=create)
            written, schema, took = rollout_to_store(self.source, self.prompts[lo:hi], self.seeds[lo:hi], recipe,
                                                     sink=sink, **self._kwargs(lo, hi))
            fragments += list(written)
            seconds += took
        return fragments, schema, seconds
