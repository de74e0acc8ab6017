"""Soak: a long run of the default recipe under a stream of transient faults and repeated SIGKILLs,
checked against a fault-free run of the same seed (issue 20).

    .venv/bin/python benchmarks/soak.py --iterations 200 --p 0.05 --kills 5 --out docs/runs/soak_default_200

1. The fault-free reference: `pixrl train --iterations N --seed S` in its own work directory (or
   `--reference WORKDIR` to reuse one).
2. The soak, in another: the same command with PIXRL_CHAOS=p:seed (a TransientError at every stage's
   fault point — after its work, before its commit — with probability p per attempt; task retries
   must absorb them) and M SIGKILLs of the main process at random moments (drawn from the seed:
   M distinct iterations, a random delay into each), each followed by `pixrl resume`. A run that
   exhausts a stage's retries also fails and is resumed (counted).
3. Checks: final trainable weights bit-identical (sha256 over the tensors), the Lance table holds
   exactly N × batch rows with unique sample ids and no missing image, reward or advantage, every
   per-iteration MLflow metric has each step 0..N-1 exactly once, every killed process's children
   (the API server and its watchdog) are gone within 10 s, no pixrl process is left at the end and
   the run's lock is free.

Writes summary.json (and the soak's log) to --out. Not a test: it takes as long as two runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lance
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from pixrl.flows.processes import alive, children

RUN = "soak"
PER_ITERATION = ("time/iteration_s", "time/generate_s", "time/update_s", "policy_version", "loss", "grad_norm")


def pixrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "pixrl.cli", *args]


def weights_digest(workdir: Path, run: str) -> tuple[str, str]:
    """(sha256 over the final checkpoint's tensors, its directory) of the run's newest checkpoint."""
    ck = max((workdir / "checkpoints" / run).glob("*/it_*"), key=lambda p: p.name)
    tensors = load_file(str(ck / "trainable.safetensors"))
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].contiguous().view(-1).numpy().tobytes())
    return h.hexdigest(), str(ck)


def reference_run(wd: Path, a, log) -> float:
    t0 = time.time()
    rc = subprocess.run(pixrl("train", "--iterations", str(a.iterations), "--seed", str(a.seed), "--run", RUN,
                              "--workdir", str(wd), *a.overrides), stdout=log, stderr=log, check=False).returncode
    if rc:
        sys.exit(f"the reference run failed (exit {rc}); see {log.name}")
    return time.time() - t0


def started(wd: Path, iteration: int) -> bool:
    """Whether the soak run has begun iteration `iteration` (its generate record or later exists)."""
    return any((wd / "records" / RUN).glob(f"*/it_{iteration:04d}"))


def soak_run(wd: Path, a, log) -> dict:
    rng = random.Random(a.seed * 7919 + a.chaos_seed)
    kill_at = sorted(rng.sample(range(1, a.iterations - 1), a.kills))
    env = {**os.environ, "PIXRL_CHAOS": f"{a.p}:{a.chaos_seed}"}
    kills, failures, orphans, attempts = [], 0, [], 0
    cmd = pixrl("train", "--iterations", str(a.iterations), "--seed", str(a.seed), "--run", RUN, "--workdir", str(wd),
                *a.overrides)
    t0 = time.time()
    while True:
        attempts += 1
        log.write(f"\n=== soak attempt {attempts}: {' '.join(cmd[3:])}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
        target = kill_at[len(kills)] if len(kills) < len(kill_at) else None
        while proc.poll() is None:
            if target is not None and started(wd, target):
                time.sleep(rng.uniform(0.0, 8.0))  # somewhere inside iteration `target`
                if proc.poll() is not None:
                    break
                kids = children(proc.pid)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                time.sleep(10)
                left = [k for k in kids if alive(k)]
                orphans += left
                kills.append({"iteration": target, "children": len(kids), "alive_after_10s": left})
                log.write(f"\n=== SIGKILL during iteration {target}; children {kids}, alive after 10 s: {left}\n")
                break
            time.sleep(0.5)
        if proc.returncode == 0:
            break
        if proc.returncode != -signal.SIGKILL:
            failures += 1  # a stage exhausted its retries: the run failed and is resumed
            if failures > 10:
                sys.exit(f"the soak failed {failures} times; see {log.name}")
        cmd = pixrl("resume", RUN, "--workdir", str(wd))
    return {"kills": kills, "failed_and_resumed": failures, "attempts": attempts, "orphans": orphans,
            "wall_s": round(time.time() - t0, 1)}


def check_stores(wd: Path, a) -> dict:
    ds = lance.dataset(str(wd / "lance" / RUN / "trajectories.lance"))
    t = ds.to_table(columns=["sample_id", "iteration", "image", "reward", "advantage"])
    per_it = {}
    for it in t["iteration"].to_pylist():
        per_it[it] = per_it.get(it, 0) + 1
    ids = t["sample_id"].to_pylist()
    c = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    run = c.search_runs([e.experiment_id for e in c.search_experiments()],
                        filter_string=f"tags.`pixrl.run_name` = '{RUN}'")[0]
    steps = {}
    for key in PER_ITERATION:
        hist = [m.step for m in c.get_metric_history(run.info.run_id, key)]
        steps[key] = {"n": len(hist), "duplicates": len(hist) - len(set(hist)),
                      "missing": sorted(set(range(a.iterations)) - set(hist))[:10]}
    return {"rows": t.num_rows, "rows_per_iteration": sorted(set(per_it.values())), "iterations": len(per_it),
            "duplicate_sample_ids": len(ids) - len(set(ids)),
            "null": {k: t[k].null_count for k in ("image", "reward", "advantage")},
            "metric_steps": steps, "mlflow_status": run.info.status}


def leftovers(wd: Path) -> dict:
    from pixrl.artifacts.run_lock import RunLock, RunLocked

    procs = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                cmdline = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(wd) in cmdline or ("uvicorn" in cmdline and "prefect" in cmdline) or "_server_watchdog" in cmdline:
                procs.append(cmdline[:120])
    try:
        with RunLock(wd, RUN):
            lock_free = True
    except RunLocked:
        lock_free = False
    return {"processes": procs, "lock_free": lock_free}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--p", type=float, default=0.05, help="transient-fault probability per stage attempt")
    ap.add_argument("--kills", type=int, default=5, help="SIGKILL/resume cycles")
    ap.add_argument("--seed", type=int, default=0, help="run seed (also draws the kill moments)")
    ap.add_argument("--chaos-seed", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--reference", default=None, help="work directory of a finished fault-free run to reuse")
    ap.add_argument("--out", default=None, help="write summary.json and soak.log here")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    base = Path(a.workdir or tempfile.mkdtemp(prefix="pixrl-soak-"))
    out = Path(a.out) if a.out else base
    out.mkdir(parents=True, exist_ok=True)
    summary = {"iterations": a.iterations, "p": a.p, "kills_planned": a.kills, "seed": a.seed,
               "chaos_seed": a.chaos_seed, "overrides": a.overrides}
    with open(out / "soak.log", "w") as log:
        ref = Path(a.reference) if a.reference else base / "reference"
        if not a.reference:
            summary["reference_wall_s"] = round(reference_run(ref, a, log), 1)
        summary["soak"] = soak_run(base / "soak", a, log)
    text = (out / "soak.log").read_text(errors="replace")
    summary["soak"]["transient_faults"] = text.count("pixrl chaos: injected random transient fault")
    summary["soak"]["retries_exhausted"] = sum("Retries are exhausted" in ln and "injected random" in ln
                                               for ln in text.splitlines())
    ref_digest, ref_ck = weights_digest(ref, RUN)
    soak_digest, soak_ck = weights_digest(base / "soak", RUN)
    summary.update(reference_weights=ref_digest, soak_weights=soak_digest, reference_checkpoint=Path(ref_ck).name,
                   soak_checkpoint=Path(soak_ck).name, stores=check_stores(base / "soak", a))
    time.sleep(10)
    summary["leftovers"] = leftovers(base / "soak")
    st, s = summary["stores"], summary["soak"]
    checks = {
        "weights bit-identical to the fault-free run": ref_digest == soak_digest,
        "every iteration's rows, once": st["iterations"] == a.iterations and st["duplicate_sample_ids"] == 0
        and len(st["rows_per_iteration"]) == 1,
        "no missing image, reward or advantage": not any(st["null"].values()),
        "every metric step once": all(v["duplicates"] == 0 and not v["missing"] for v in st["metric_steps"].values()),
        f"{a.kills} SIGKILLs, no child alive 10 s after": len(s["kills"]) == a.kills and not s["orphans"],
        "no process left, lock free": not summary["leftovers"]["processes"] and summary["leftovers"]["lock_free"],
        "MLflow run FINISHED": st["mlflow_status"] == "FINISHED",
    }
    summary["checks"] = checks
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for name, ok in checks.items():
        print(f"- {'ok  ' if ok else 'FAIL'} {name}")
    print(json.dumps({k: summary[k] for k in ("soak", "reference_weights", "soak_weights")}, indent=1))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
