"""Step time with reward.overlap against the sequential loop: the default recipe through the real
`pixrl train`, with a slow reward added (default: the Open-NSFW ResNet-50 penalty on every image
beside the shapes judge), runs alternated A B B A … in fresh work directories so both modes meet
the same machine. Reported per mode: the median iteration wall (iteration 0, which loads the
model and the scorer, left out) and the median stage times; with overlap, decode and score are
mostly the wait for the background thread.

    .venv/bin/python benchmarks/overlap.py [--iterations 6] [--repeats 2] [--out FILE] [key=value ...]
    .venv/bin/python benchmarks/overlap.py --served "shapes,nsfw:0.1" nsfw.threads=1   # the reward on its own core

`--served SET`: the reward set runs in `pixrl reward-serve` pinned to the last core (`taskset`)
and the run, with reward=remote and one torch thread, to the others — a reward on its own device,
as the seed systems serve model-based rewards; the trailing key=value are the server's options.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STAGES = ("generate", "decode", "score", "replay", "update", "publish")


def one_run(overlap: bool, iterations: int, overrides: list[str], prefix: list[str] = ()) -> dict:
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory(prefix="pixrl-overlap-") as wd:
        cmd = [*prefix, sys.executable, "-m", "pixrl.cli", "train", "--iterations", str(iterations), "--workdir", wd,
               "--run", "bench", f"reward.overlap={str(overlap).lower()}", *overrides]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        run_id = json.loads(out.stdout.strip().splitlines()[-1])["run_id"]
        c = MlflowClient(f"sqlite:///{Path(wd) / 'mlflow.db'}")

        def median(key: str) -> float | None:
            vals = [m.value for m in c.get_metric_history(run_id, key) if m.step > 0]
            return statistics.median(vals) if vals else None

        res = {"iteration_s": median("time/iteration_s"),
               **{f"{s}_s": median(f"time/{s}_s") for s in STAGES},
               "score_compute_s": median("score_compute_s"), "decode_compute_s": median("decode_compute_s"),
               "generate_compute_s": median("generate_compute_s")}
        if overlap:
            res["decode_wait_s"], res["score_wait_s"] = median("overlap/decode_wait_s"), median("overlap/score_wait_s")
        return res


def _serve(rewards: str, options: list[str]):
    """`pixrl reward-serve` on the last core; (process, url, the run's taskset prefix, its overrides)."""
    import os
    import socket
    import time

    import httpx

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("--served needs at least 2 cores")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["taskset", "-c", str(cores[-1]), sys.executable, "-m", "pixrl.cli", "reward-serve",
                             "--reward", rewards, "--port", str(port), *options],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.3)
    else:
        proc.kill()
        sys.exit("reward-serve did not come up")
    run_cores = ",".join(map(str, cores[:-1]))
    return proc, url, ["taskset", "-c", run_cores], [
        "reward=remote", f"reward.options.remote.url={url}", f"run.threads={len(cores) - 1}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2, help="pairs of runs (A B, then B A, …)")
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    ap.add_argument("--served", default=None, help="serve this reward set (NAME[:W],…) on its own core")
    ap.add_argument("overrides", nargs="*", help="default: reward.weights={shapes: 1.0, nsfw: 0.1}")
    a = ap.parse_args()
    overrides = a.overrides or ["reward.weights={shapes: 1.0, nsfw: 0.1}"]
    prefix, server = [], None
    if a.served:
        server, url, prefix, overrides = _serve(a.served, a.overrides)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for rep in range(a.repeats):
        for overlap in ((False, True) if rep % 2 == 0 else (True, False)):
            r = one_run(overlap, a.iterations, overrides, prefix)
            runs[overlap].append(r)
            print(f"overlap={overlap}: {r['iteration_s']:.2f} s/iteration  " +
                  " ".join(f"{s} {r[f'{s}_s']:.2f}" for s in STAGES), flush=True)
    if server is not None:
        server.terminate()
        server.wait(10)
    summary = {"overrides": overrides, "iterations": a.iterations, "repeats": a.repeats, "served": a.served}
    for overlap, rs in runs.items():
        name = "overlap" if overlap else "sequential"
        summary[name] = {k: statistics.median([r[k] for r in rs]) for k in rs[0] if rs[0][k] is not None}
    seq, ov = summary["sequential"]["iteration_s"], summary["overlap"]["iteration_s"]
    summary["step_time_change"] = ov / seq - 1
    print(json.dumps(summary, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
