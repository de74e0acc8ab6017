"""Benchmark of the online loop: per-stage seconds and orchestration overhead
(1 − Σ stage seconds / iteration wall time) on the default recipe, read back from MLflow; then,
in the same invocation, the bare loop (benchmarks/bare_loop.py: the same iteration as plain torch)
and the ratio of median iteration wall times, pipeline / bare; and the bytes the run keeps per
iteration (checkpoints + MLflow artifacts; the trajectory table against its rows' payload).

    .venv/bin/python benchmarks/online_loop.py --iterations 21 [key=value ...]
    .venv/bin/python benchmarks/online_loop.py --existing WORKDIR RUN_NAME   # figures of a finished run

Prints a markdown table for the README. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

STAGES = ("generate", "decode", "score", "replay", "update", "publish")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--existing", nargs=2, metavar=("WORKDIR", "RUN"), help="report a finished run instead")
    ap.add_argument("--no-bare", action="store_true", help="skip the bare-loop comparison")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    total = float("nan")
    if a.existing:
        wd = Path(a.existing[0])
        c = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
        exps = [e.experiment_id for e in c.search_experiments()]
        run = c.search_runs(exps, filter_string=f"tags.`pixrl.run_name` = '{a.existing[1]}'",
                            order_by=["attributes.start_time DESC"], max_results=1)[0]
        info = {"run_id": run.info.run_id}
        a.iterations = len(c.get_metric_history(run.info.run_id, "time/iteration_s"))
    else:
        wd = Path(a.workdir or tempfile.mkdtemp(prefix="pixrl-bench-"))
        cmd = [sys.executable, "-m", "pixrl.cli", "train", "--iterations", str(a.iterations), "--workdir", str(wd),
               "--run", "bench", "run.eval_every=0", *a.overrides]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        total = time.perf_counter() - t0
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        info = json.loads(out.stdout.strip().splitlines()[-1])
        c = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")

    def hist(key: str) -> list[float]:
        return [m.value for m in sorted(c.get_metric_history(info["run_id"], key), key=lambda m: m.step)]

    skip = 1 if a.iterations > 1 else 0  # iteration 0 includes model loading
    rows = {s: hist(f"time/{s}_s")[skip:] for s in STAGES}
    it = hist("time/iteration_s")[skip:]
    ov = hist("orchestration_overhead")[skip:]
    ips = hist("images_per_s")[skip:]
    print(f"{a.iterations} iterations\n\n| stage | median s/iteration |\n|---|---|")
    for s in STAGES:
        print(f"| {s} | {statistics.median(rows[s]):.2f} |")
    print(f"| **iteration (wall)** | {statistics.median(it):.2f} |")
    print(f"\norchestration overhead (median): {100 * statistics.median(ov):.1f}% ; "
          f"generate throughput: {statistics.median(ips):.1f} images/s ; "
          f"process wall incl. start-up: {total:.0f} s")
    print_storage(wd, info["run_id"], a.iterations)
    if not a.existing and not a.no_bare:
        from bare_loop import run_bare

        bare = run_bare(["run.eval_every=0", *a.overrides], a.iterations)[skip:]
        print(f"\nbare loop (plain torch, same work): median {statistics.median(bare):.2f} s/iteration; "
              f"pipeline / bare = **{statistics.median(it) / statistics.median(bare):.3f}** "
              f"(iterations {skip}–{a.iterations - 1})")


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
