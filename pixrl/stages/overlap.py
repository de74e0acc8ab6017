"""reward.overlap: decode and score each finished micro-batch of a rollout in a background
thread while the next micro-batch generates — so a slow reward (OCR, a model-based scorer, a
remote service) costs step time only where it outlasts generation.

The loop stays on-policy and the stages stay what they are: generate commits the rollout, then
decode and score commit the columns the background thread computed — or, when there is nothing
prefetched (a resumed run, a retried stage, another process), compute them the same way. In
both cases decode and score run per micro-batch of the rollout's own geometry (rows in
generation order, `sampling.micro_batch` at a time) and score reads the pixels back from the
stored bytes, so a run gives bit-identical rewards with or without the prefetch.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..artifacts.media import decode_media, media_bytes, png_bytes

log = logging.getLogger("pixrl.train")


@dataclass
class Chunk:
    """One micro-batch's decoded bytes and (when scored) rewards."""

    sample_ids: list[str]
    blobs: list[bytes]
    posters: list[bytes] | None
    decode_s: float
    scores: dict[str, np.ndarray] | BaseException | None = None  # an exception: the score stage raises it
    score_s: float = 0.0
    soundtracks: list[bytes] | None = None  # a sounding clip's soundtrack (WAV)


def decode_chunk(engine, decode_input: np.ndarray, sample_ids: list[str], prompts: list[str]) -> Chunk:
    """Images (clips, with their soundtracks) of one micro-batch as the trajectory row stores them."""
    t0 = time.perf_counter()
    imgs = engine.decode(decode_input, prompts)
    blobs = [media_bytes(im) for im in imgs]
    posters = [png_bytes(clip[0]) for clip in imgs] if imgs.ndim == 5 else None
    sounds = engine.soundtracks(decode_input)
    return Chunk(list(sample_ids), blobs, posters, time.perf_counter() - t0, soundtracks=sounds)


def score_chunk(engine, blobs: list[bytes], prompts: list[str], metadata: list[dict],
                sample_ids: list[str], soundtracks: list[bytes] | None = None) -> tuple[dict[str, np.ndarray], float]:
    """One micro-batch's rewards, from the pixels read back from its stored bytes (what the score
    stage reads: a clip's MP4 frames, not the decoder's), and the soundtracks it stores."""
    if soundtracks is not None:
        metadata = [{**m, "soundtrack": s} for m, s in zip(metadata, soundtracks)]
    imgs = np.stack([decode_media(b) for b in blobs])
    t0 = time.perf_counter()
    scores = engine.score(imgs, prompts, metadata, sample_ids)
    return scores, time.perf_counter() - t0


def generation_order(group_ids, sample_indices, micro_batch: int) -> list[np.ndarray]:
    """Row positions of a stored round in the order generate sampled them, cut into its micro-batches."""
    order = np.lexsort((np.asarray(sample_indices), np.asarray(group_ids)))
    return [order[i:i + micro_batch] for i in range(0, len(order), micro_batch)]


def merge_scores(chunks: list[Chunk], positions: list[np.ndarray], n: int) -> dict[str, np.ndarray]:
    """Per-chunk rewards back into the stored rows' order; a chunk's scoring error is raised."""
    out: dict[str, np.ndarray] = {}
    for ch, pos in zip(chunks, positions):
        if isinstance(ch.scores, BaseException):
            raise ch.scores
        for k, v in ch.scores.items():  # NaN where a per-task reward scored no sample of a chunk
            out.setdefault(k, np.full(n, np.nan, np.float32))[pos] = v
    return out


def _one_torch_thread() -> None:
    """The background thread's own torch ops (the decoder) use one intra-op thread, so they take
    a core beside the sampler's instead of a second team on all of them (OpenMP's thread count
    is per calling thread)."""
    import torch

    torch.set_num_threads(1)


@dataclass
class _Pending:
    futures: list[Future] = field(default_factory=list)
    generate_version: int | None = None  # the table version generate committed these rows in
    decode_version: int | None = None  # the version decode committed the prefetched bytes in


class ScoringOverlap:
    """The background decode+score of the rounds this process generates, keyed (iteration, round)."""

    def __init__(self, engine, micro_batch: int):
        self.engine, self.micro_batch = engine, micro_batch
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pixrl-overlap", initializer=_one_torch_thread)
        self._pending: dict[tuple[int, int], _Pending] = {}

    def begin(self, key: tuple[int, int], sample_ids: list[str], prompts: list[str], metadata: list[dict]):
        """The rollout's `on_chunk` hook for this round's rows (given in generation order)."""
        self.discard(key)
        pend = self._pending[key] = _Pending()

        def job(decode_input: np.ndarray, lo: int, hi: int) -> Chunk:
            ch = decode_chunk(self.engine, decode_input, sample_ids[lo:hi], prompts[lo:hi])
            try:
                ch.scores, ch.score_s = score_chunk(self.engine, ch.blobs, prompts[lo:hi], metadata[lo:hi],
                                                    sample_ids[lo:hi], ch.soundtracks)
            except BaseException as exc:  # decode's bytes still commit; the score stage fails with this
                ch.scores = exc
            return ch

        def on_chunk(lo: int, hi: int, decode_input: np.ndarray) -> None:
            if hi <= lo or hi - lo > self.micro_batch:  # (a part of the rollout starts its own micro-batches)
                raise RuntimeError(f"rows [{lo}, {hi}) are not one micro-batch of {self.micro_batch}")
            pend.futures.append(self._pool.submit(job, decode_input, lo, hi))

        return on_chunk

    def committed(self, key: tuple[int, int], version: int) -> None:
        if key in self._pending:
            self._pending[key].generate_version = version

    def discard(self, key: tuple[int, int]) -> None:
        pend = self._pending.pop(key, None)
        for f in pend.futures if pend else ():
            f.cancel()

    def _chunks(self, pend: _Pending, ordered_ids: list[str]) -> tuple[list[Chunk], float] | None:
        t0 = time.perf_counter()
        chunks = [f.result() for f in pend.futures]  # a decode error is raised here, in the decode stage
        if [s for ch in chunks for s in ch.sample_ids] != ordered_ids:
            log.warning("the prefetched decode does not cover the stored rows; decoding them again")
            return None
        return chunks, time.perf_counter() - t0

    def decoded(self, key: tuple[int, int], version: int, ordered_ids: list[str]) -> tuple[list[Chunk], float] | None:
        """The round's prefetched chunks and the seconds waited for them, if generate committed
        them in `version` in this process; None: decode them now."""
        pend = self._pending.get(key)
        if pend is None or pend.generate_version != version:
            self.discard(key)
            return None
        try:
            got = self._chunks(pend, ordered_ids)
        except BaseException:
            self.discard(key)
            raise
        if got is None:
            self.discard(key)
        return got

    def decode_committed(self, key: tuple[int, int], version: int) -> None:
        if key in self._pending:
            self._pending[key].decode_version = version

    def scored(self, key: tuple[int, int], version: int, ordered_ids: list[str]) -> tuple[list[Chunk], float] | None:
        """The round's prefetched rewards, if decode committed the prefetched bytes in `version`."""
        pend = self._pending.pop(key, None)
        if pend is None or pend.decode_version != version:
            return None
        return self._chunks(pend, ordered_ids)

    def close(self) -> None:
        for key in list(self._pending):
            self.discard(key)
        self._pool.shutdown(wait=True, cancel_futures=True)
