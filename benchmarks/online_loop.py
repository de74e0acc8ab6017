"""Benchmark of the online loop: per-stage seconds and orchestration overhead
(1 − Σ stage seconds / iteration wall time) on the default recipe, read back from MLflow; the
ratio of median iteration wall times against the bare loop (benchmarks/bare_loop.py: the same
iteration as plain torch) run in the same invocation over the same iterations, interleaved with
the pipeline in chunks (benchmarks/interleave.py: the machine's speed wanders too much for a
run-then-run comparison); and the bytes the run keeps per iteration (checkpoints + MLflow
artifacts; the trajectory table against its rows' payload).

    .venv/bin/python benchmarks/online_loop.py --iterations 25 [--chunk 6] [key=value ...]
    .venv/bin/python benchmarks/online_loop.py --existing WORKDIR RUN_NAME   # figures of a finished run
    .venv/bin/python benchmarks/online_loop.py --history 300 [--iterations-measured 24] [key=value ...]

`--history N` measures the loop late in a long run (issue 14: ≤ 1.10 × the bare loop at
iteration 300) without running N iterations: `pixrl train --iterations N+K` runs iteration 0 for
real and fails at iteration 1 before its first commit (PIXRL_FAULT=generate@1:raise); the stores
are checked to hold nothing of iteration 1; `synthetic_history.py` writes iterations 1..N-1 into
the run's trajectory table, checkpoint store and registry the way the pipeline does (from
iteration 0's rows and checkpoint); `pixrl resume` then fast-forwards the N published iterations
and runs iterations N..N+K-1 for real, chunk by chunk, interleaved with the bare loop from the
weights of iteration N-1. Reported: pre-fill and fast-forward seconds, the medians over the
measured iterations (each chunk's first loads the model and is left out), the ratio, the bytes
kept, and checks that the resume started at iteration N (MLflow steps, Lance rows, registry).

Prints markdown for the README. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleave import bare_loop, measured_iterations, report, run_interleaved  # noqa: E402

STAGES = ("generate", "decode", "score", "replay", "update", "publish")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--existing", nargs=2, metavar=("WORKDIR", "RUN"), help="report a finished run instead")
    ap.add_argument("--no-bare", action="store_true", help="skip the bare-loop comparison")
    ap.add_argument("--history", type=int, default=0, metavar="N",
                    help="measure at iteration N of a synthetic history (iterations 1..N-1 pre-filled); 0: off")
    ap.add_argument("--iterations-measured", type=int, default=20, metavar="K",
                    help="with --history: iterations run for real after the history (N..N+K-1)")
    ap.add_argument("--chunk", type=int, default=6,
                    help="iterations per chunk when the pipeline and the bare loop are interleaved")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.history:
        return run_history(a)
    total = float("nan")
    if a.existing:
        wd = Path(a.existing[0])
        c = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
        exps = [e.experiment_id for e in c.search_experiments()]
        run = c.search_runs(exps, filter_string=f"tags.`pixrl.run_name` = '{a.existing[1]}'",
                            order_by=["attributes.start_time DESC"], max_results=1)[0]
        info = {"run_id": run.info.run_id}
        a.iterations = len(c.get_metric_history(run.info.run_id, "time/iteration_s"))
        measured = list(range(1 if a.iterations > 1 else 0, a.iterations))  # iteration 0 loads the model
    else:
        wd = Path(a.workdir or tempfile.mkdtemp(prefix="pixrl-bench-"))
        if (wd / "mlflow.db").exists():
            sys.exit(f"{wd} already holds a pixrl work directory; the benchmark needs a new one")
        env = {k_: v for k_, v in os.environ.items() if k_ != "PIXRL_FAULT"}
        cmd = [sys.executable, "-m", "pixrl.cli", "train", "--iterations", str(a.iterations), "--workdir", str(wd),
               "--run", RUN, "run.eval_every=0", *a.overrides]
        resume = [sys.executable, "-m", "pixrl.cli", "resume", RUN, "--workdir", str(wd)]
        t0 = time.perf_counter()
        inter = run_interleaved(cmd, resume, env, 0, a.iterations, a.chunk,
                                None if a.no_bare else bare_loop(a.overrides, None))
        total = time.perf_counter() - t0
        info = inter.info
        c = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
        measured = measured_iterations(inter, 0, a.iterations)

    def hist(key: str) -> list[float]:
        by_step = {m.step: m.value for m in c.get_metric_history(info["run_id"], key)}
        return [by_step[s] for s in measured if s in by_step]

    rows = {s: hist(f"time/{s}_s") for s in STAGES}
    it = hist("time/iteration_s")
    ov = hist("orchestration_overhead")
    ips = hist("images_per_s")
    print(f"{a.iterations} iterations, medians over {len(measured)} of them\n\n| stage | median s/iteration |\n|---|---|")
    for s in STAGES:
        print(f"| {s} | {statistics.median(rows[s]):.2f} |")
    print(f"| **iteration (wall)** | {statistics.median(it):.2f} |")
    print(f"\norchestration overhead (median): {100 * statistics.median(ov):.1f}% ; "
          f"generate throughput: {statistics.median(ips):.1f} images/s ; "
          f"benchmark wall: {total:.0f} s")
    print_storage(wd, info["run_id"], a.iterations)
    if not a.existing:
        report(c, info["run_id"], inter, measured)


RUN = "bench"
FAULT = "generate@1:raise"


def run_history(a) -> None:
    """--history N: iteration 0 for real, iterations 1..N-1 pre-filled, N..N+K-1 for real after a
    resume (see the module docstring)."""
    from synthetic_history import committed, open_stores, prefill, summary

    n, k = a.history, a.iterations_measured
    if a.existing or n < 1 or k < 1:
        sys.exit("--history N (N ≥ 1) takes --iterations-measured K (K ≥ 1) and no --existing")
    wd = Path(a.workdir or tempfile.mkdtemp(prefix="pixrl-bench-history-"))
    if (wd / "mlflow.db").exists():
        sys.exit(f"{wd} already holds a pixrl work directory; --history needs a new one")
    env = {k_: v for k_, v in os.environ.items() if k_ != "PIXRL_FAULT"}
    started = time.perf_counter()

    # 1. iteration 0 for real; iteration 1 fails before its first commit
    cmd = [sys.executable, "-m", "pixrl.cli", "train", "--iterations", str(n + k), "--run", RUN, "--workdir", str(wd),
           "run.eval_every=0", *a.overrides]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env={**env, "PIXRL_FAULT": FAULT}, check=False)
    first_s = time.perf_counter() - t0
    if out.returncode == 0 or "injected fault in generate (iteration 1)" not in " ".join(out.stderr.split()):
        sys.exit(f"expected `pixrl train` to fail with the injected fault at iteration 1 (rc {out.returncode}):\n"
                 f"{out.stderr[-3000:]}")
    stores = open_stores(wd, RUN)
    run_id = stores.spec.run_id
    checks: list[tuple[bool, str]] = []
    it0, it1 = committed(stores, 0), committed(stores, 1)
    checks.append((it0["rows"] > 0 and all(it0[s] for s in ("decode", "score", "replay")) and it0["checkpoint"]
                   and it0["version"] is not None, f"iteration 0 complete after the first attempt: {it0}"))
    checks.append((it1["rows"] == 0 and not it1["checkpoint"] and not it1["staging"] and it1["version"] is None
                   and not it1["metrics"],
                   (f"iteration 1's failed attempt committed nothing (its generate record, written before the "
                    f"fault point, is what a retry replaces): {it1}")))
    versions0 = stores.table.latest_version()
    print(f"workdir {wd}; run {RUN} ({run_id}); `pixrl train` with PIXRL_FAULT={FAULT}: {first_s:.0f} s "
          f"(start-up, iteration 0, failure at 1); table at version {versions0}")

    # 2. iterations 1..N-1 pre-filled
    t0 = time.perf_counter()
    times = prefill(stores, n) if n > 1 else {"total": []}
    prefill_s = time.perf_counter() - t0
    if times["total"]:
        print(f"\npre-filled iterations 1–{n - 1} in {prefill_s:.0f} s "
              f"({prefill_s / (n - 1):.3f} s per iteration)\n\n{summary(times)}")
    queries = sorted({round(i * (n - 1) / 9) for i in range(10)})  # the fast-forward's registry query
    q_s = []
    for it in queries:
        t0 = time.perf_counter()
        ok = stores.published(it) is not None
        q_s.append(time.perf_counter() - t0)
        checks.append((ok, f"iteration {it} published before the resume"))
    ds = stores.table.dataset()
    print(f"\nbefore the resume: table version {ds.version}, {len(ds.versions())} versions kept, "
          f"{len(ds.tags.list())} tags, {len(ds.get_fragments())} fragments; "
          f"{len(stores.tracker.run_versions(stores.spec.model_name, run_id))} registered versions; "
          f"registry query `published(it)`: median {statistics.median(q_s) * 1e3:.1f} ms over iterations {queries}")

    # 3. resume: fast-forward 0..N-1, iterations N..N+K-1 for real, in chunks interleaved with the
    #    bare loop over the same iterations from the weights the pipeline's iteration N rolls out with
    init = stores.layout.checkpoint(n - 1)
    init = init if (init / "trainable.safetensors").is_file() else None
    resume = [sys.executable, "-m", "pixrl.cli", "resume", RUN, "--workdir", str(wd)]
    inter = run_interleaved(resume, resume, env, n, n + k, a.chunk, None if a.no_bare else bare_loop(a.overrides, init))
    t_resume, resume_s, info = inter.first_start, inter.first_s, inter.info
    checks.append((info["run_id"] == run_id, f"resume continued MLflow run {run_id}"))
    c = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")

    def hist(key: str) -> dict[int, object]:
        return {m.step: m for m in c.get_metric_history(run_id, key)}

    walls = hist("time/iteration_s")
    pv = hist("policy_version")
    ff = sorted(s for s in pv if 1 <= s < n)  # logged by the fast-forward (the pre-fill logs nothing)
    start_n = (walls[n].timestamp / 1e3 - walls[n].value) if n in walls else float("nan")
    per_ff = ((pv[ff[-1]].timestamp - pv[ff[0]].timestamp) / 1e3 / (len(ff) - 1)) if len(ff) > 1 else float("nan")
    print(f"\n`pixrl resume`: {resume_s:.0f} s; from its start to iteration {n}'s start {start_n - t_resume:.1f} s "
          f"(process start-up, run reopening, fast-forward over {n} published iterations); fast-forward "
          f"{per_ff:.3f} s per iteration (policy_version timestamps, iterations {ff[0] if ff else '–'}–"
          f"{ff[-1] if ff else '–'})")

    # 4. figures of the measured iterations (the first of each chunk loads the model)
    steps = measured_iterations(inter, n, n + k)
    stage = {s: hist(f"time/{s}_s") for s in STAGES}
    ov, ips = hist("orchestration_overhead"), hist("images_per_s")

    def med(h: dict) -> float:
        return statistics.median(h[s].value for s in steps if s in h)

    print(f"\niterations {_ranges(steps)} after a history of {n} (the first iteration of each chunk, "
          f"{inter.chunk_starts}, left out: it loads the model)\n\n| stage | median s/iteration |\n|---|---|")
    for s in STAGES:
        print(f"| {s} | {med(stage[s]):.2f} |")
    it_med = med(walls)
    print(f"| **iteration (wall)** | {it_med:.2f} |")
    print(f"\norchestration overhead (median): {100 * med(ov):.1f}% ; generate throughput: {med(ips):.1f} images/s ; "
          f"iteration {n} (with model load): {walls[n].value:.2f} s")
    print_storage(wd, run_id, n + k)
    report(c, run_id, inter, steps)

    # 5. the resume started at iteration N and the stores hold N+K iterations
    checks += check_history(c, stores, n, k)
    print("\nchecks:")
    for ok, what in checks:
        print(f"- {'ok  ' if ok else 'FAIL'} {what}")
    print(f"\nbenchmark wall: {time.perf_counter() - started:.0f} s")
    if not all(ok for ok, _ in checks):
        sys.exit(1)


def check_history(c: MlflowClient, stores, n: int, k: int) -> list[tuple[bool, str]]:
    """After the resume: MLflow steps, Lance rows per iteration, registry versions, checkpoints."""
    import pyarrow.compute as pc

    run_id, total = stores.spec.run_id, n + k
    out = []
    for key in ("time/iteration_s", "time/generate_s", "time/update_s"):
        steps = sorted(m.step for m in c.get_metric_history(run_id, key))
        out.append((steps == [0, *range(n, total)], f"{key} logged at steps 0 and {n}–{total - 1} only: {_ranges(steps)}"))
    pv = sorted(m.step for m in c.get_metric_history(run_id, "policy_version"))
    out.append((pv == list(range(total)), f"policy_version at every step 0–{total - 1}: {_ranges(pv)}"))
    t = stores.table.dataset().to_table(columns=["iteration", "policy_version", "image", "reward", "advantage"],
                                        filter=f"run_id = '{run_id}'")
    counts = {r["values"]: r["counts"] for r in pc.value_counts(t["iteration"]).to_pylist()}
    per = set(counts.values())
    out.append((sorted(counts) == list(range(total)) and len(per) == 1,
                f"Lance rows for iterations 0–{total - 1}, {per} per iteration: {_ranges(sorted(counts))}"))
    out.append((all(t[col].null_count == 0 for col in ("image", "reward", "advantage")),
                "every row has image, reward and advantage"))
    tags = set(stores.table.dataset().tags.list())
    out.append((all(f"{RUN}-it{i}-generate" in tags for i in range(total)), f"{len(tags)} tags <run>-it<N>-generate"))
    mvs = stores.tracker.run_versions(stores.spec.model_name, run_id)
    by_it = {}
    for mv in mvs:
        by_it.setdefault(int(mv.tags["iteration"]), []).append(int(mv.version))
    out.append((sorted(by_it) == list(range(total)) and all(len(v) == 1 for v in by_it.values()),
                f"{len(mvs)} registered versions, one per iteration 0–{total - 1}"))
    version = {i: v[0] for i, v in by_it.items()}
    out.append((all(version[i] < version[i + 1] for i in range(total - 1) if i in version and i + 1 in version),
                "versions increase with the iteration"))
    alias = stores.tracker.client.get_registered_model(stores.spec.model_name).aliases.get("rollout")
    out.append((str(alias) == str(version.get(total - 1)), f"alias rollout → version {alias} (iteration {total - 1})"))
    pol = {}
    for it_, p in zip(t["iteration"].to_pylist(), t["policy_version"].to_pylist()):
        pol.setdefault(it_, set()).add(p)
    bad = [i for i in range(1, total) if pol.get(i) != {version.get(i - 1)}]
    out.append((not bad, f"rows of iteration i rolled out with iteration i-1's version (i = 1–{total - 1})"
                         + (f"; not at {bad[:5]}" if bad else "")))
    ck = stores.layout.checkpoints
    dirs = sorted(p.name for p in ck.iterdir())
    keep = stores.spec.cfg.run.retention.keep_full or total  # older ones are retention's to prune
    newest = [f"it_{i:04d}" for i in range(max(0, total - keep), total)]
    stray = [d for d in dirs if not d.startswith("it_") or int(d[3:]) >= total]
    out.append((set(newest) <= set(dirs) and not stray,
                f"checkpoints: the newest {len(newest)} (retention keep_full) present, no staging or stray directory"))
    recs = sorted(p.name for p in stores.layout.records.iterdir())
    out.append((set(recs) >= {f"it_{i:04d}" for i in range(n, total)},
                f"stage records for iterations {n}–{total - 1} (and {sorted(set(recs) - {f'it_{i:04d}' for i in range(n, total)})})"))
    return out


def _ranges(xs: list[int]) -> str:
    """[0, 30, 31, 32] → '0, 30–32'."""
    parts, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        parts.append(str(xs[i]) if i == j else f"{xs[i]}–{xs[j]}")
        i = j + 1
    return ", ".join(parts) or "none"


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def print_storage(wd: Path, run_id: str, iterations: int) -> None:
    """Bytes kept per iteration: checkpoints + MLflow artifacts against one checkpoint; the
    trajectory table's bytes against its rows' payload (latents, log-probs, PNG, rewards)."""
    import lance
    import pyarrow.compute as pc

    ckpts = sorted((wd / "checkpoints").rglob("it_*"))
    one = _bytes(ckpts[-1]) if ckpts else 0
    kept = (_bytes(wd / "checkpoints") + _bytes(wd / "mlruns")) / max(iterations, 1)
    print(f"\nkept per iteration (checkpoints + mlruns): {kept / 1e6:.1f} MB = {kept / max(one, 1):.2f}× one checkpoint "
          f"({one / 1e6:.1f} MB)")
    for table in (wd / "lance").rglob("trajectories.lance"):
        t = lance.dataset(str(table)).to_table(filter=f"run_id = '{run_id}'")
        png = pc.sum(pc.binary_length(t["image"])).as_py() or 0
        payload = png + sum(t[c].nbytes for c in ("latents", "next_latents", "final_latent", "log_probs", "rewards",
                                                  "reward", "advantage"))
        print(f"trajectory table: {_bytes(table) / 1e6:.1f} MB on disk for {payload / 1e6:.1f} MB of payload "
              f"= {_bytes(table) / max(payload, 1):.2f}× ({lance.dataset(str(table)).version} versions)")


if __name__ == "__main__":
    main()
