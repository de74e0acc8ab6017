"""Start-up of `pixrl train` on the miniature: seconds from launching the command to the start of
iteration 0's generate stage (the first stage's work), for a fresh work directory and for a second
run in the same one (MLflow store and Prefect database already created). Also the seconds to the
end of that stage (the first rollout stored, the model load included): work moved out of start-up
into the stage shows there. Compare two trees with `PYTHONPATH=TREE` (each start runs in its work
directory, so the current directory's checkout does not shadow it).

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


def first_stage(workdir: Path, run: str) -> tuple[float, float]:
    """(start, end) of iteration 0's generate, epoch seconds."""
    c = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    r = c.search_runs([e.experiment_id for e in c.search_experiments()],
                      filter_string=f"tags.`pixrl.run_name` = '{run}'")[0]
    m = [x for x in c.get_metric_history(r.info.run_id, "time/generate_s") if x.step == 0][0]
    return m.timestamp / 1000 - m.value, m.timestamp / 1000


def one(workdir: Path, run: str, overrides: list[str]) -> tuple[float, float]:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "pixrl.cli", "train", "--iterations", "1", "--run", run,
                          "--workdir", str(workdir), "run.eval_every=0", *overrides], capture_output=True, text=True, check=False,
                         cwd=workdir)  # not the caller's directory: a checkout there would shadow PYTHONPATH's pixrl
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    start, end = first_stage(workdir, run)
    return start - t0, end - t0


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
    print("| work directory | start-up to the first stage's work (median s) | to the first rollout stored (median s) | runs (start-up / rollout) |")
    print("|---|---|---|---|")
    for name, xs in (("fresh", fresh), ("existing", again)):
        runs = ", ".join(f"{a:.2f} / {b:.2f}" for a, b in xs)
        print(f"| {name} | {statistics.median(a for a, _ in xs):.2f} | {statistics.median(b for _, b in xs):.2f} | {runs} |")


if __name__ == "__main__":
    main()
