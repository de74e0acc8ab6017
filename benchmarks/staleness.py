"""One-step-off rollouts on the Ray engine: seconds per iteration of the real flow with
`run.staleness=0` (generate → … → update in turn) against `run.staleness=1` (iteration i + 1's
rollout begun on the rollout workers while iteration i scores and trains; stages/rollout_prefetch.py),
the same recipe, workers and iterations.

    .venv/bin/python benchmarks/staleness.py [--iterations 8] [--out docs/runs/bench_staleness] [key=value ...]

Default layout on a 2-core machine: one rollout worker and one trainer rank, 1 CPU and 1 thread
each, one reward worker (the default recipe's shapes judge); the gain is bounded by how much of
an iteration the rollout and the update are (a rollout hidden behind the update, or the reverse).
Reported per setting: the median of MLflow's `time/iteration_s` over the iterations after the
first two (start-up, and staleness 1's first iteration, which has nothing begun ahead), each
stage's median seconds, and how long generate waited for the rollout begun ahead
(`prefetch/wait_s`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUT = ["run.engine=ray", "ray.rollout_workers=1", "ray.reward_workers=1", "ray.trainer_workers=1",
          "ray.rollout.num_cpus=1", "ray.trainer.num_cpus=1", "ray.reward.num_cpus=0", "run.threads=1",
          "run.eval_every=0"]
STAGES = ["generate", "decode", "score", "replay", "update", "publish"]


def _median(client, run_id: str, key: str, skip: int) -> float | None:
    vals = [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step) if m.step >= skip]
    return statistics.median(vals) if vals else None


def run(staleness: int, iterations: int, overrides: list[str], workdir: Path) -> dict:
    from mlflow.tracking import MlflowClient

    cmd = [sys.executable, "-m", "pixrl.cli", "train", "--iterations", str(iterations), "--run", f"s{staleness}",
           "--workdir", str(workdir), *LAYOUT, f"run.staleness={staleness}", *overrides]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stdout[-2000:] + out.stderr[-3000:])
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    rid, skip = summary["run_id"], 2
    return {"staleness": staleness, "iteration_s": _median(client, rid, "time/iteration_s", skip),
            **{f"{s}_s": _median(client, rid, f"time/{s}_s", skip) for s in STAGES},
            "prefetch_wait_s": _median(client, rid, "prefetch/wait_s", skip),
            "proximal_recompute_s": _median(client, rid, "off_policy/recompute_s", skip),
            "reward_last": _median(client, rid, "reward/reward/mean", iterations - 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--out", default=None, help="a folder for result.json")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for staleness in (0, 1):
            rows.append(run(staleness, a.iterations, a.overrides, Path(tmp) / f"s{staleness}"))
            print(json.dumps(rows[-1]), flush=True)
    speedup = rows[0]["iteration_s"] / rows[1]["iteration_s"]
    result = {"iterations": a.iterations, "layout": LAYOUT, "overrides": a.overrides, "rows": rows,
              "speedup": speedup}
    print(f"s/iteration: staleness 0 {rows[0]['iteration_s']:.2f}, staleness 1 {rows[1]['iteration_s']:.2f} "
          f"(×{speedup:.2f})")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
