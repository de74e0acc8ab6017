"""Benchmark of the trajectory store over a long history (issue 14): per-stage store seconds
early in a run vs late, and bytes on disk per iteration vs the rows' payload.

    .venv/bin/python benchmarks/store_history.py                      # 300 iterations, ~2-3 min on 2 cores
    .venv/bin/python benchmarks/store_history.py --iterations 60      # quicker
    .venv/bin/python benchmarks/store_history.py --store legacy --iterations 120   # the merge_insert store, for comparison
    .venv/bin/python benchmarks/store_history.py --latent 4,16,16     # bigger rows

It plays the store's side of every iteration the way the local engine does: generate checks
the key and appends 128 rows (default recipe's shapes: `latents`/`next_latents` 4 stored steps
× [4,8,8] float32, `final_latent`, log-probs, timesteps) and tags the version; decode, score
and replay each check completeness (two counts), read their inputs at the previous stage's
version and write their columns in one commit; update reads the training columns back; then
`maintain_store` runs (every `--maintain-every` iterations). Rows are synthetic (pyarrow, the
table's own `trajectory_schema`), PNGs are ~1 KB random blobs. Every operation is timed; the
report compares the median over iterations 1–20 with the median over the last 20, and prints
bytes on disk per iteration (overall and over the last 20 iterations) against the payload.
Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pixrl.artifacts.store_maintenance import maintain_store
from pixrl.artifacts.trajectories import (
    KEY,
    StoreError,
    TableRef,
    TrajectoryStore,
    fixed_list,
    rewards_column,
    tensor_column,
    trajectory_schema,
)

RUN = "0123456789abcdef0123456789abcdef"  # an MLflow-like run id
OPS = ("generate.count", "generate.append", "generate.tag",
       "decode.check", "decode.read", "decode.merge",
       "score.check", "score.read", "score.merge",
       "replay.check", "replay.read", "replay.merge",
       "update.read", "maintain")
STAGES = {"generate": ("generate.count", "generate.append", "generate.tag"),
          "decode": ("decode.check", "decode.read", "decode.merge"),
          "score": ("score.check", "score.read", "score.merge"),
          "replay": ("replay.check", "replay.read", "replay.merge"),
          "update": ("update.read",)}


class LegacyStore(TrajectoryStore):
    """The store before issue 14: full-table filters and `merge_insert` (whole-row rewrites)."""

    def count(self, run_id, iteration, version=None, where=None):
        if not self.exists():
            return 0
        f = f"run_id = '{run_id}' AND iteration = {int(iteration)}" + (f" AND ({where})" if where else "")
        return self.dataset(version).count_rows(filter=f)

    def merge(self, table):
        ds = self.dataset()
        run, it = table["run_id"][0].as_py(), table["iteration"][0].as_py()
        have = self.count(run, it)
        if have != table.num_rows:
            raise StoreError(f"merge of {table.num_rows} rows into run {run!r} iteration {it}, which holds {have}")
        ds.merge_insert(KEY).when_matched_update_all().execute(table)
        return TableRef(self.uri, self.dataset().version)

    def read(self, ref, run_id, iteration, columns):
        cols = columns if "sample_id" in columns else ["sample_id", *columns]
        t = self.dataset(ref.version).to_table(
            columns=cols, filter=f"run_id = '{run_id}' AND iteration = {int(iteration)}")
        return t.sort_by("sample_id").select(columns)

    def tag(self, name, version):
        ds = self.dataset()
        if name in ds.tags.list():
            ds.tags.update(name, version)
        else:
            ds.tags.create(name, version)


class Rows:
    """Synthetic rows with the default recipe's shapes."""

    def __init__(self, rows: int, group: int, stored: int, latent: tuple[int, int, int], steps: int, png: int):
        self.n, self.g, self.s, self.latent, self.steps, self.png = rows, group, stored, latent, steps, png
        self.schema = trajectory_schema(stored, latent, steps)

    def generate(self, it: int) -> pa.Table:
        rng = np.random.default_rng(it)
        n, g, s, T = self.n, self.g, self.s, self.steps
        sid = [f"{it:05d}-{i // g:03d}-{i % g:02d}" for i in range(n)]
        meta = json.dumps({"objects": [{"shape": "circle", "colour": "red"}], "relation": None})
        recipe = json.dumps({"sampler": "sde", "steps": T, "noise_level": 0.7, "train_steps": list(range(s))})
        f32 = np.float32
        return pa.Table.from_arrays([
            pa.array([RUN] * n), pa.array([it] * n, pa.int32()), pa.array(sid),
            pa.array([f"p{(it * 7 + i // g) % 500:04d}" for i in range(n)]),
            pa.array([f"a red circle above a blue square #{i // g}" for i in range(n)]), pa.array([meta] * n),
            pa.array([i // g for i in range(n)], pa.int32()), pa.array([i % g for i in range(n)], pa.int32()),
            pa.array(rng.integers(0, 2**62, n), pa.int64()), pa.array([it] * n, pa.int32()),
            pa.array(["sd3"] * n), pa.array(["full_sequence"] * n), pa.array(["denoise"] * n), pa.array([recipe] * n),
            fixed_list(np.tile(np.linspace(1000, 100, T, dtype=f32), (n, 1)), T),
            fixed_list(np.tile(np.linspace(1, 0, T + 1, dtype=f32), (n, 1)), T + 1),
            fixed_list(np.tile(np.arange(s, dtype=np.int32), (n, 1)), s, pa.int32()),
            tensor_column(rng.standard_normal((n, s, *self.latent), dtype=f32)),
            tensor_column(rng.standard_normal((n, s, *self.latent), dtype=f32)),
            fixed_list(rng.standard_normal((n, s), dtype=f32), s),
            tensor_column(rng.standard_normal((n, *self.latent), dtype=f32)),
            pa.nulls(n, pa.binary()), pa.nulls(n, self.schema.field("rewards").type), pa.nulls(n, pa.float32()),
            pa.nulls(n, pa.float32()),
        ], schema=self.schema)

    def image(self, keys: pa.Table, it: int) -> pa.Table:
        rng = np.random.default_rng(10_000 + it)
        pngs = [b"\x89PNG\r\n\x1a\n" + rng.bytes(self.png - 8) for _ in range(keys.num_rows)]
        return _with(keys, image=pa.array(pngs, pa.binary()))

    def reward(self, keys: pa.Table, it: int) -> pa.Table:
        rng = np.random.default_rng(20_000 + it)
        n = keys.num_rows
        parts = {k: rng.random(n).astype(np.float32) for k in ("shapes", "counts", "colours", "relation")}
        return _with(keys, rewards=rewards_column(parts, n), reward=pa.array(parts["shapes"], pa.float32()))

    def advantage(self, keys: pa.Table, it: int) -> pa.Table:
        rng = np.random.default_rng(30_000 + it)
        return _with(keys, advantage=pa.array(rng.standard_normal(keys.num_rows).astype(np.float32), pa.float32()))


def _with(keys: pa.Table, **cols) -> pa.Table:
    return pa.table({"run_id": keys["run_id"], "iteration": keys["iteration"], "sample_id": keys["sample_id"], **cols})


def disk_bytes(root: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for dirpath, _, files in os.walk(root):
        top = os.path.relpath(dirpath, root).split(os.sep)[0]
        out[top] = out.get(top, 0) + sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return out


def one_iteration(st: TrajectoryStore, rows: Rows, it: int, times: dict[str, list[float]]) -> None:
    def timed(op, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        times[op].append(time.perf_counter() - t0)
        return out

    def complete(col):
        n = st.count(RUN, it)
        return n > 0 and st.count(RUN, it, where=f"{col} IS NOT NULL") == n

    key = ["run_id", "iteration", "sample_id"]
    table = rows.generate(it)
    assert timed("generate.count", st.count, RUN, it) == 0
    ref = timed("generate.append", st.append, table)
    timed("generate.tag", st.tag, f"bench-it{it}-generate", ref.version)
    assert not timed("decode.check", complete, "image")
    t = timed("decode.read", st.read, ref, RUN, it, [*key, "final_latent"])
    ref = timed("decode.merge", st.merge, rows.image(t, it))
    assert not timed("score.check", complete, "reward")
    t = timed("score.read", st.read, ref, RUN, it, [*key, "prompt", "prompt_meta", "image"])
    assert t["image"].null_count == 0
    ref = timed("score.merge", st.merge, rows.reward(t, it))
    assert not timed("replay.check", complete, "advantage")
    t = timed("replay.read", st.read, ref, RUN, it, [*key, "group_id", "reward"])
    ref = timed("replay.merge", st.merge, rows.advantage(t, it))
    t = timed("update.read", st.read, ref, RUN, it,
              ["sample_id", "prompt", "latents", "next_latents", "log_probs", "timesteps", "advantage"])
    assert t.num_rows == rows.n and t["advantage"].null_count == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--window", type=int, default=20, help="iterations compared at the start and at the end")
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--stored-steps", type=int, default=4)
    ap.add_argument("--latent", default="4,8,8", help="C,H,W of a latent (the shipped miniature: 4,8,8)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--png-bytes", type=int, default=1024)
    ap.add_argument("--store", choices=("current", "legacy"), default="current")
    ap.add_argument("--maintain-every", type=int, default=10, help="0: never run maintain_store")
    ap.add_argument("--keep-versions", type=int, default=8)
    ap.add_argument("--index", default="BITMAP", help="BITMAP, BTREE or none")
    ap.add_argument("--dir", default=None, help="where the table goes (default: a temporary directory, removed)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args()
    latent = tuple(int(x) for x in a.latent.split(","))
    rows = Rows(a.rows, a.group, a.stored_steps, latent, a.steps, a.png_bytes)
    tmp = None if a.dir else tempfile.mkdtemp(prefix="pixrl-store-")
    uri = str(Path(a.dir or tmp) / "trajectories.lance")
    shutil.rmtree(uri, ignore_errors=True)
    st = (LegacyStore if a.store == "legacy" else TrajectoryStore)(uri)
    index = None if a.index.lower() == "none" else a.index.upper()
    times: dict[str, list[float]] = {op: [] for op in OPS}
    sizes, started = [], time.perf_counter()
    try:
        for it in range(a.iterations):
            one_iteration(st, rows, it, times)
            t0 = time.perf_counter()
            if a.maintain_every:
                maintain_store(st, it, every=a.maintain_every, index=index, keep_versions=a.keep_versions,
                               older_than=timedelta(0))
            times["maintain"].append(time.perf_counter() - t0)
            sizes.append(sum(disk_bytes(uri).values()))
            if (it + 1) % 50 == 0:
                print(f"  iteration {it + 1}: {sizes[-1] / 1e6:.1f} MB, version {st.latest_version()}, "
                      f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        full = st.read(TableRef(uri, st.latest_version()), RUN, 0, st.dataset().schema.names)
        payload = full.nbytes
        latents = sum(full[c].nbytes for c in ("latents", "next_latents", "final_latent", "image"))
        breakdown = disk_bytes(uri)
        ds = st.dataset()
        report(a, times, sizes, payload, latents, breakdown, ds.version, len(ds.versions()), len(ds.tags.list()),
               len(ds.get_fragments()), time.perf_counter() - started)
        check = lance.dataset(uri, version=ds.tags.get_version("bench-it0-generate")).to_table(
            filter="iteration = 0", columns=["sample_id", "image"])
        assert check.num_rows == a.rows and check["image"].null_count == a.rows, "the tagged version changed"
        last = lance.dataset(uri).to_table(filter=f"iteration = {a.iterations - 1}", columns=["advantage"])
        assert last.num_rows == a.rows and last["advantage"].null_count == 0
        if a.json:
            Path(a.json).write_text(json.dumps({"times": times, "sizes": sizes, "payload": payload,
                                                "breakdown": breakdown, "args": vars(a)}))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def report(a, times, sizes, payload, latents, breakdown, version, n_versions, n_tags, n_frags, seconds) -> None:
    w, n = a.window, a.iterations
    early = slice(1, 1 + w)  # iteration 0 creates the table
    late = slice(max(n - w, 1), n)

    def med(op, sl):
        v = times[op][sl]
        if op == "maintain":  # runs every N iterations: its cost spread over the iterations
            return statistics.fmean(v) if v else float("nan")
        return statistics.median(v) if v else float("nan")

    print(f"\n## Trajectory store over {n} iterations ({a.store} store, {a.rows} rows, latents "
          f"{a.stored_steps}×[{a.latent}] f32, maintain every {a.maintain_every or '—'}, index {a.index})\n")
    print(f"| operation | median s, iterations 1–{w} | median s, iterations {late.start}–{n - 1} |")
    print("|---|---|---|")
    for op in OPS:
        name = f"{op} (mean per iteration)" if op == "maintain" else op
        print(f"| {name} | {med(op, early):.4f} | {med(op, late):.4f} |")
    for stage, ops in STAGES.items():
        e = statistics.median([sum(times[op][i] for op in ops) for i in range(early.start, min(early.stop, n))] or [0])
        lt = statistics.median([sum(times[op][i] for op in ops) for i in range(late.start, n)] or [0])
        print(f"| **{stage}** (store total) | **{e:.4f}** | **{lt:.4f}** |")
    per_it = sizes[-1] / n
    tail = (sizes[-1] - sizes[late.start - 1]) / (n - late.start) if n > late.start else float("nan")
    print(f"\npayload per iteration (Arrow bytes of the {a.rows} filled rows): {payload / 1e6:.3f} MB "
          f"(latents, final latent and PNGs: {latents / 1e6:.3f} MB)")
    print(f"bytes on disk: {sizes[-1] / 1e6:.1f} MB = {per_it / 1e6:.3f} MB per iteration "
          f"({per_it / payload:.2f}× payload); over the last {n - late.start} iterations "
          f"{tail / 1e6:.3f} MB per iteration ({tail / payload:.2f}×)")
    print("on disk by folder: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(breakdown.items())))
    print(f"latest version {version}, {n_versions} versions kept, {n_tags} tags, {n_frags} fragments; "
          f"{seconds:.0f} s in all")


if __name__ == "__main__":
    main()
