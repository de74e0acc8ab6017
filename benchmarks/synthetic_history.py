"""A synthetic history for a real run: iterations 1..N-1 written into the run's stores the way
the pipeline writes them, from the run's real iteration 0, so the run can be resumed at
iteration N with a trajectory table and a model registry that hold N iterations
(`benchmarks/online_loop.py --history N`, issue 14: iteration wall time at iteration 300).

What it needs: a run whose iteration 0 is complete (rows with every column, checkpoint
`it_0000`, a registered version) and whose later iterations hold nothing — e.g.
`pixrl train ... ` with `PIXRL_FAULT=generate@1:raise`, which fails iteration 1 before its
first commit. What it writes for each iteration `it` = 1..N-1, in the pipeline's order and with
the pipeline's store calls:

- generate: `maintain_store(store, it)` (index update + version cleanup every 10 iterations, as
  generate calls it), then one `TrajectoryStore.append` of iteration 0's rows with `iteration`,
  `sample_id` (`f"{it:05d}-{slot:03d}-{g:02d}"`) and `policy_version` (the version published for
  it-1, what generate records as the rollout policy) rewritten and the columns the later stages
  fill (`image`; `rewards`, `reward`; `advantage`: `completion.FILLED_BY`) null; the version is
  tagged `<run>-it<it>-generate`;
- decode, score, replay: one `TrajectoryStore.merge` each of iteration 0's values of their
  columns — so the table gets the pipeline's 4 versions, 1 fragment and 1 tag per iteration;
- update: `it_0000` copied to `it_<it:04d>` (through a staging directory renamed into place:
  complete or absent). Same files, same checkpoint id: the copy is the same weights;
- publish: `Tracker.publish(run_id, dir, it, model_name, checkpoint_id, {"run_name": run})`, which
  registers the directory as a version tagged with the iteration and moves alias `rollout`, so
  `RunStores.published(it)` (the flow's fast-forward) finds it.

Nothing is logged to MLflow: the synthetic iterations are not measured (no `time/*`, no
`policy_version`; a resume's fast-forward logs `policy_version` for them, as it does after a
crash). Each part is skipped when the stores already hold it (the pipeline's completion marks,
`stages/completion.py`), so an interrupted pre-fill can be rerun. Not a test; used by the
benchmark only.

    from synthetic_history import open_stores, prefill
    stores = open_stores(workdir, "bench")
    timings = prefill(stores, 300)            # iterations 1..299
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from pathlib import Path

import pyarrow as pa

from pixrl.artifacts.checkpoints import read_counters
from pixrl.artifacts.store_maintenance import maintain_store
from pixrl.artifacts.tracking import Tracker, default_tracking_uri
from pixrl.artifacts.trajectories import KEY, TableRef
from pixrl.run import RunSpec
from pixrl.stages.completion import FILLED_BY, RunStores

#: the parts of one synthetic iteration, in the pipeline's order (the keys of prefill's timings)
PARTS = ("maintain", "generate", "decode", "score", "replay", "update", "publish")


def open_stores(workdir: str | Path, run_name: str) -> RunStores:
    """The stores of the newest run named `run_name` in `workdir`: its MLflow run (tag
    `pixrl.run_name`), trajectory table (tag `pixrl.table_uri`), registered model (tag
    `pixrl.model_name`) and checkpoint directory."""
    wd = Path(workdir).resolve()
    tracker = Tracker(default_tracking_uri(wd))
    run_id = tracker.find_run("pixrl.run_name", run_name)
    if run_id is None:
        raise SystemExit(f"no run named {run_name!r} in {wd}")
    tags = tracker.client.get_run(run_id).data.tags
    spec = RunSpec(config=tracker.read_config(run_id), run_id=run_id, run_name=run_name, workdir=str(wd),
                   tracking_uri=tracker.uri, table_uri=tags["pixrl.table_uri"], model_name=tags["pixrl.model_name"])
    return RunStores(spec, tracker)


def committed(stores: RunStores, iteration: int) -> dict[str, object]:
    """What the stores hold of one iteration, stage by stage: rows (count), filled columns
    (decode/score/replay complete), checkpoint directory and any staging directory left by an
    interrupted write, registered version, and the MLflow metric keys logged at its step.
    Used to check that a failed attempt left nothing behind."""
    layout = stores.layout
    staging = sorted(p.name for p in layout.checkpoints.glob(f"it_{iteration:04d}.staging-*")) \
        if layout.checkpoints.is_dir() else []
    run = stores.tracker.client.get_run(stores.spec.run_id)
    logged = sorted(k for k in run.data.metrics
                    if any(m.step == iteration for m in stores.tracker.client.get_metric_history(stores.spec.run_id, k)))
    published = stores.published(iteration)
    return {"rows": stores.table.count(stores.spec.run_id, iteration),
            **{stage: stores.complete(stage, iteration) for stage in FILLED_BY},
            "checkpoint": stores.layout.checkpoint(iteration).exists(), "staging": staging,
            "version": published.version if published else None, "metrics": logged,
            "records": sorted(p.name for p in layout.record("x", iteration).parent.glob("*.json"))}


def template_rows(stores: RunStores, iteration: int = 0) -> pa.Table:
    """Every column of `iteration`'s rows at the table's latest version (all stages filled)."""
    ds = stores.table.dataset()
    t = stores.table.read(TableRef(stores.table.uri, ds.version), stores.spec.run_id, iteration, ds.schema.names)
    if t.num_rows == 0:
        raise SystemExit(f"run {stores.spec.run_name!r} has no rows for iteration {iteration}")
    for stage in FILLED_BY:
        if not stores.complete(stage, iteration):
            raise SystemExit(f"iteration {iteration} of run {stores.spec.run_name!r} is not complete ({stage})")
    return t


def iteration_rows(template: pa.Table, iteration: int, policy_version: int) -> pa.Table:
    """The template's rows as iteration `iteration`'s: `iteration`, `sample_id` (leading 5 digits)
    and `policy_version` rewritten, every other column as it is."""
    n = template.num_rows
    sids = template["sample_id"].to_pylist()
    if any(len(s) < 6 or not s[:5].isdigit() or s[5] != "-" for s in sids):
        raise ValueError(f"sample ids {sids[:3]} are not <iteration:05d>-<slot:03d>-<g:02d>")
    new = {"iteration": pa.array([iteration] * n, template.schema.field("iteration").type),
           "sample_id": pa.array([f"{iteration:05d}{s[5:]}" for s in sids], template.schema.field("sample_id").type),
           "policy_version": pa.array([policy_version] * n, template.schema.field("policy_version").type)}
    out = template
    for name, arr in new.items():
        i = out.schema.get_field_index(name)
        out = out.set_column(i, out.schema.field(i), arr)
    return out


def generate_rows(rows: pa.Table) -> pa.Table:
    """`rows` as generate appends them: the columns decode, score and replay fill are null."""
    out = rows
    for cols in FILLED_BY.values():
        for c in cols:
            i = out.schema.get_field_index(c)
            out = out.set_column(i, out.schema.field(i), pa.nulls(out.num_rows, out.schema.field(i).type))
    return out


def copy_checkpoint(src: Path, dst: Path) -> None:
    """Copy a checkpoint directory to `dst` through a staging directory renamed into place."""
    staging = dst.with_name(dst.name + ".staging-synthetic")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(src, staging)
    staging.rename(dst)


def prefill_iteration(stores: RunStores, template: pa.Table, iteration: int, policy_version: int,
                      checkpoint0: Path, checkpoint_id: str) -> tuple[int, dict[str, float]]:
    """Write one synthetic iteration (see the module docstring); returns (its registered version,
    seconds per part). A part the stores already hold is skipped."""
    spec, store = stores.spec, stores.table
    rows = iteration_rows(template, iteration, policy_version)
    t: dict[str, float] = {p: 0.0 for p in PARTS}

    def timed(part, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        t[part] += time.perf_counter() - t0
        return out

    if not stores.complete("generate", iteration):
        if store.exists():
            timed("maintain", maintain_store, store, iteration)
        ref = timed("generate", store.append, generate_rows(rows))
        timed("generate", store.tag, f"{spec.run_name}-it{iteration}-generate", ref.version)
    for stage, cols in FILLED_BY.items():
        if not stores.complete(stage, iteration):
            timed(stage, store.merge, rows.select([*KEY, *cols]))
    dst = stores.layout.checkpoint(iteration)
    copied = not dst.exists()
    if copied:
        timed("update", copy_checkpoint, checkpoint0, dst)
    # a version is registered only after its directory exists: a fresh copy has none yet (this
    # saves a registry query that costs O(versions of the run))
    done = None if copied else stores.published(iteration)
    if done is None:
        done = timed("publish", stores.tracker.publish, spec.run_id, dst, iteration, spec.model_name, checkpoint_id,
                     {"run_name": spec.run_name})
    return done.version, t


def prefill(stores: RunStores, iterations: int, start: int = 1, log=None) -> dict[str, list[float]]:
    """Write synthetic iterations start..iterations-1 from iteration 0 (rows and checkpoint).
    Returns seconds per part and per iteration (`total`), one entry per iteration written.
    `log`: a callable taking a progress line (default: stderr every 50 iterations)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    template = template_rows(stores, 0)
    checkpoint0 = stores.layout.checkpoint(0)
    checkpoint_id = read_counters(checkpoint0)["checkpoint_id"]
    prev = stores.published(start - 1)
    if prev is None:
        raise SystemExit(f"iteration {start - 1} of run {stores.spec.run_name!r} is not published")
    version = prev.version  # the rollout policy of the next iteration
    times: dict[str, list[float]] = {p: [] for p in (*PARTS, "total")}
    t_all = time.perf_counter()
    for it in range(start, iterations):
        t0 = time.perf_counter()
        version, t = prefill_iteration(stores, template, it, version, checkpoint0, checkpoint_id)
        for p in PARTS:
            times[p].append(t[p])
        times["total"].append(time.perf_counter() - t0)
        if (it + 1) % 50 == 0 or it + 1 == iterations:
            log(f"  pre-filled iteration {it}: table version {stores.table.latest_version()}, "
                f"{time.perf_counter() - t_all:.0f} s so far")
    return times


def summary(times: dict[str, list[float]], window: int = 20) -> str:
    """One markdown table: median seconds per part over the first and the last `window` iterations."""
    n = len(times["total"])
    if not n:
        return "no iterations pre-filled"
    head, tail = slice(0, min(window, n)), slice(max(n - window, 0), n)
    lines = [f"| pre-fill part | median s, first {head.stop} | median s, last {tail.stop - tail.start} |",
             "|---|---|---|"]
    for p in (*PARTS, "total"):
        v = times[p]
        if p == "maintain":  # every 10th iteration: its cost spread over the iterations
            lines.append(f"| {p} (mean per iteration) | {statistics.fmean(v[head]):.3f} | {statistics.fmean(v[tail]):.3f} |")
        else:
            lines.append(f"| {p} | {statistics.median(v[head]):.3f} | {statistics.median(v[tail]):.3f} |")
    return "\n".join(lines)
