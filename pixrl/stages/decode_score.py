"""The decode and score stages of an online iteration: images into the table, rewards from it.

A mixin of `OnlineStages` (stages/online.py), which provides the stores, the engine, the
records and the stage helpers these use. Three ways each, one outcome (one table version):
- in process: read the iteration's rows, call the engine, merge the columns;
- reward.overlap: the bytes or rewards a background thread made while generate ran
  (stages/overlap.py), or the same per-micro-batch work now;
- an engine whose workers read and write the table (`decode_to_store`, `score_from_store`:
  artifacts/column_writes.py), so latents and images never pass through this process.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from ..artifacts.batch import DECODE_INPUT, RolloutBatch
from ..artifacts.column_writes import check_decoded, decoded_columns, score_columns, score_inputs, score_metadata
from ..artifacts.trajectories import TableRef, rewards_column
from .overlap import Chunk, decode_chunk, generation_order, merge_scores, score_chunk


class DecodeScoreStages:
    # --- decode -------------------------------------------------------------------------------
    def decode(self, iteration: int, ref: TableRef, rnd: int = 0) -> TableRef:
        return self._timed(self.stage_name("decode", rnd), iteration, lambda: self._decode(iteration, ref, rnd))

    def _decode(self, iteration: int, ref: TableRef, rnd: int):
        if self.stores.complete("decode", iteration, rnd):
            return self.stores.latest(), None
        field = DECODE_INPUT[self.step_kind]  # final latents, or a token family's image tokens
        scope = self.stores.round_scope(rnd)
        self._check_soundtrack_column(ref)
        if self.overlap is not None:
            return self._decode_chunked(iteration, ref, rnd, field, scope)
        to_store = getattr(self.engine, "decode_to_store", None)  # workers write the image columns themselves
        if to_store is not None:
            reads = self.table.fragment_reads(ref, self.spec.run_id, iteration, scope)
            files, seconds = to_store(reads, field)
            metrics = self._commit_record("decode", iteration, rnd, {"decode_compute_s": seconds})
            return self.table.commit_columns(reads, files), metrics
        t = self._read(ref, iteration, ["run_id", "iteration", "sample_id", "prompt", field], where=scope)
        batch = RolloutBatch.from_arrow(t.select([field]))
        t0 = time.perf_counter()  # images [B, H, W, 3] or clips [B, F, H, W, 3]
        cols = decoded_columns(self.engine, batch[field], t["prompt"].to_pylist())
        seconds = time.perf_counter() - t0  # the sample grid is logged by the iteration's report
        upd = pa.table({"run_id": t["run_id"], "iteration": t["iteration"], "sample_id": t["sample_id"], **cols})
        metrics = self._commit_record("decode", iteration, rnd, {"decode_compute_s": seconds})
        return self.table.merge(upd, where=scope), metrics

    def _check_soundtrack_column(self, ref: TableRef) -> None:
        """A family whose clips have sound stores them: refuse a table made before soundtracks
        were stored (no `soundtrack` column), before anything is decoded."""
        if self.engine.describe().get("audio") and "soundtrack" not in self.table.dataset(ref.version).schema.names:
            raise RuntimeError(f"{self.table.uri} has no `soundtrack` column for this run's sounding clips (it was "
                               "made by a pixrl that kept soundtracks only in the latents); start a new run (`pixrl train --run NEW`)")

    ORDER = ["group_id", "sample_index"]  # with sample_id: generation order (reward.overlap)

    def _decode_chunked(self, iteration: int, ref: TableRef, rnd: int, field: str, scope):
        """reward.overlap's decode: the bytes the background thread made while generate ran, or
        (nothing prefetched) the same per-micro-batch decode now."""
        key, keys = (iteration, rnd), ["run_id", "iteration", "sample_id"]
        t = self._read(ref, iteration, [*keys, *self.ORDER], where=scope)
        sids = t["sample_id"].to_pylist()
        parts = generation_order(t["group_id"].to_numpy(), t["sample_index"].to_numpy(), self.cfg.sampling.micro_batch)
        got = self.overlap.decoded(key, ref.version, [sids[i] for p in parts for i in p])
        metrics: dict = {}
        if got is None:
            data = RolloutBatch.from_arrow(self._read(ref, iteration, ["sample_id", "prompt", field], where=scope))
            pos = {sid: i for i, sid in enumerate(data["sample_id"])}
            chunks = [decode_chunk(self.engine, data[field][[pos[sids[i]] for i in p]], [sids[i] for i in p],
                                   [data["prompt"][pos[sids[i]]] for i in p]) for p in parts]
        else:
            chunks, metrics["overlap/decode_wait_s"] = got
        blob = {s: b for ch in chunks for s, b in zip(ch.sample_ids, ch.blobs)}
        cols = {"image": pa.array([blob[s] for s in sids], pa.binary())}
        for column in ("posters", "soundtracks"):  # a clip's poster frame, a sounding clip's soundtrack
            if chunks and getattr(chunks[0], column) is not None:
                got = {s: b for ch in chunks for s, b in zip(ch.sample_ids, getattr(ch, column))}
                cols[column[:-1]] = pa.array([got[s] for s in sids], pa.binary())
        metrics["decode_compute_s"] = sum(ch.decode_s for ch in chunks)
        upd = pa.table({k: t[k] for k in keys} | cols)
        metrics = self._commit_record("decode", iteration, rnd, metrics)
        out = self.table.merge(upd, where=scope)
        if got is not None:
            self.overlap.decode_committed(key, out.version)
        return out, metrics

    # --- score --------------------------------------------------------------------------------
    def score(self, iteration: int, ref: TableRef, rnd: int = 0) -> TableRef:
        return self._timed(self.stage_name("score", rnd), iteration, lambda: self._score(iteration, ref, rnd))

    def _score(self, iteration: int, ref: TableRef, rnd: int):
        if self.stores.complete("score", iteration, rnd):
            return self.stores.latest(), None
        scope = self.stores.round_scope(rnd)
        from_store = getattr(self.engine, "score_from_store", None)  # workers read the images themselves
        keys = ["run_id", "iteration", "sample_id"]
        metrics = {}
        if from_store is not None:
            t = self._read(ref, iteration, keys, where=scope)
            reads = self.table.rows_read(ref, self.spec.run_id, iteration, t["sample_id"].to_pylist(), scope)
            scores, seconds = from_store(reads, iteration)
        else:
            order = self.ORDER if self.overlap is not None else []
            cols = score_columns(self.table.dataset(ref.version).schema.names)
            t = self._read(ref, iteration, [*keys, *cols[1:], *order], where=scope)
            if self.overlap is not None:
                check_decoded(t, iteration)
                scores, seconds = self._score_chunked(iteration, ref, rnd, t, metrics)
            else:
                imgs, prompts, metas, sids = score_inputs(t, iteration)
                t0 = time.perf_counter()
                scores = self.engine.score(imgs, prompts, metas, sids)
                seconds = time.perf_counter() - t0
        upd = pa.table({"run_id": t["run_id"], "iteration": t["iteration"], "sample_id": t["sample_id"],
                        "rewards": rewards_column(scores, t.num_rows), "reward": pa.array(scores["reward"], pa.float32())})
        metrics["score_compute_s"] = seconds
        for k, v in scores.items():  # per-task rewards: over the samples each scored
            v = np.asarray(v)[~np.isnan(v)]
            if v.size:
                metrics[f"reward/{k}/mean"] = float(np.mean(v))
                metrics[f"reward/{k}/std"] = float(np.std(v))
        metrics = self._commit_record("score", iteration, rnd, metrics)
        return self.table.merge(upd, where=scope), metrics

    def _score_chunked(self, iteration: int, ref: TableRef, rnd: int, t: pa.Table, metrics: dict):
        """reward.overlap's score: the rewards the background thread computed from the bytes decode
        committed, or (nothing prefetched) the same per-micro-batch scoring now."""
        sids = t["sample_id"].to_pylist()
        parts = generation_order(t["group_id"].to_numpy(), t["sample_index"].to_numpy(), self.cfg.sampling.micro_batch)
        got = self.overlap.scored((iteration, rnd), ref.version, [sids[i] for p in parts for i in p])
        if got is None:
            blobs, prompts = t["image"].to_pylist(), t["prompt"].to_pylist()
            metas = score_metadata(t)
            chunks = []
            for p in parts:
                scores, seconds = score_chunk(self.engine, [blobs[i] for i in p], [prompts[i] for i in p],
                                              [metas[i] for i in p], [sids[i] for i in p])
                chunks.append(Chunk([sids[i] for i in p], [], None, 0.0, scores, seconds))
        else:
            chunks, metrics["overlap/score_wait_s"] = got
        return merge_scores(chunks, parts, t.num_rows), sum(ch.score_s for ch in chunks)
