"""Start-up of `pixrl train` on the miniature: seconds from launching the command to the start of
iteration 0's generate stage (the first stage's work), for a fresh work directory and for a second
run in the same one (MLflow store and Prefect database already created).

    .venv/bin/python benchmarks/startup.py [--repeats 3] [key=value ...]

The start of generate is read back from MLflow: the timestamp of `time/generate_s` at step 0 (logged
when the stage ends) minus its value. Held-out evaluation is off (run.eval_every=0): the base
policy's evaluation would otherwise come first. Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.tracking import MlflowClient


def first_stage_start(workdir: Path, run: str) -> float:
    c = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    r = c.search_runs([e.experiment_id for e in c.search_experiments()],
                      filter_string=f"tags.`pixrl.run_name` = '{run}'")[0]
    m = [x for x in c.get_metric_history(r.info.run_id, "time/generate_s") if x.step == 0][0]
    return m.timestamp / 1000 - m.value


def one(workdir: Path, run: str, overrides: list[str]) -> float:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "pixrl.cli", "train", "--iterations", "1", "--run", run,
                          "--workdir", str(workdir), "run.eval_every=0", *overrides], capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    return first_stage_start(workdir, run) - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    fresh, again = [], []
    for i in range(a.repeats):
        wd = Path(tempfile.mkdtemp(prefix="pixrl-startup-"))
        fresh.append(one(wd, "first", a.overrides))
        again.append(one(wd, "second", a.overrides))
    print("| work directory | start-up to the first stage's work (median s) | runs |")
    print("|---|---|---|")
    print(f"| fresh | {statistics.median(fresh):.2f} | {', '.join(f'{x:.2f}' for x in fresh)} |")
    print(f"| existing | {statistics.median(again):.2f} | {', '.join(f'{x:.2f}' for x in again)} |")


if __name__ == "__main__":
    main()
