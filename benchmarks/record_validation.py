"""Records a validation run of a recipe under docs/runs/<name>/: held-out and train accuracy
before and after, the reward curve (CSV + PNG), the resolved config, and evidence of learning
(optimizer updates, reward trend, weight change) in summary.json.

    .venv/bin/python benchmarks/record_validation.py --name shapes_flow_grpo_v1 --iterations 200 [key=value ...]
    .venv/bin/python benchmarks/record_validation.py --name shapes_token_grpo_v1 --config shapes_token_grpo ...
    .venv/bin/python benchmarks/record_validation.py --name shapes_dance_grpo --config shapes_dance_grpo \
        --minutes 45 --per-category 96 run.eval_every=20     # a row of docs/algorithms/README.md's table
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _eval(args: list[str], workdir: Path, per_category: int, config: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "pixrl.cli", "eval", "--json", "--per-category", str(per_category),
           "--workdir", str(workdir), *(["--config", config] if config else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _probe() -> dict:
    """The machine's speed beside the run (benchmarks/machine_probe.py), so rows recorded on
    different days can be compared."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "machine_probe.py")], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--per-category", type=int, default=48)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--reuse", action="store_true", help="the run exists in --workdir: only evaluate and record")
    ap.add_argument("--config", default=None, help="experiment preset or YAML (default: the default recipe)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="wall-clock training budget (run.time_budget_minutes); --iterations is then only a cap")
    ap.add_argument("--no-probe", action="store_true", help="skip the machine-speed probe before and after")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    if a.minutes:
        a.overrides = [*a.overrides, f"run.time_budget_minutes={a.minutes}"]
        a.iterations = max(a.iterations, 100_000)
    out_dir = ROOT / "docs" / "runs" / a.name
    out_dir.mkdir(parents=True, exist_ok=True)
    wd = Path(a.workdir or out_dir / "work").resolve()
    summary: dict = {"name": a.name, "iterations": a.iterations, "overrides": a.overrides,
                     "machine": f"{os.cpu_count()} CPU cores",
                     "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if not a.no_probe:
        summary["machine_probe_before"] = _probe()
    t0 = time.time()
    summary["heldout_before_detail"] = _eval(["--split", "heldout"], wd, a.per_category, a.config)
    summary["train_before_detail"] = _eval(["--split", "train"], wd, a.per_category, a.config)
    summary["eval_before_s"] = time.time() - t0

    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    if a.reuse:
        exps = [e.experiment_id for e in c.search_experiments()]
        run = c.search_runs(exps, filter_string=f"tags.`pixrl.run_name` = '{a.name}'",
                            order_by=["attributes.start_time DESC"], max_results=1)[0]
        info = {"run_id": run.info.run_id}
        summary["train_s"] = (run.info.end_time - run.info.start_time) / 1000
    else:
        t1 = time.time()
        cmd = [sys.executable, "-m", "pixrl.cli", "train", "--iterations", str(a.iterations), "--workdir", str(wd),
               "--run", a.name, *(["--config", a.config] if a.config else []), *a.overrides]
        wd.mkdir(parents=True, exist_ok=True)
        log_path = wd / f"{a.name}.train.log"  # written outside the repo, copied in when training ends: a git
        with log_path.open("w") as log:      # checkout or stash during the run cannot orphan the open file
            rc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        shutil.copy(log_path, out_dir / "train.log")
        if rc.returncode:
            sys.exit(f"training failed, see {out_dir / 'train.log'}")
        info = json.loads(rc.stdout.strip().splitlines()[-1])
        summary["train_s"] = time.time() - t1
    summary["mlflow_run_id"] = info["run_id"]

    t2 = time.time()
    summary["heldout_after_detail"] = _eval(["--split", "heldout", "--run", a.name], wd, a.per_category)
    summary["train_after_detail"] = _eval(["--split", "train", "--run", a.name], wd, a.per_category)
    summary["eval_after_s"] = time.time() - t2
    if not a.no_probe:
        summary["machine_probe_after"] = _probe()
    for split in ("heldout", "train"):
        for when in ("before", "after"):
            d = summary[f"{split}_{when}_detail"]
            summary[f"{split}_{when}"] = d["accuracy"]
            if "accuracy_ci_low" in d:  # 95% bootstrap interval over the evaluation samples
                summary[f"{split}_{when}_ci"] = [d["accuracy_ci_low"], d["accuracy_ci_high"]]
        summary[f"{split}_lift"] = summary[f"{split}_after"] - summary[f"{split}_before"]
    if "heldout_after_ci" in summary:
        summary["heldout_rose"] = summary["heldout_after_ci"][0] > summary["heldout_before"]
    summary["wall_minutes"] = summary["train_s"] / 60

    keys = ["reward/reward/mean", "reward/shapes.correct/mean", "reward/shapes.partial/mean", "zero_std_ratio",
            "loss", "clipfrac", "approx_kl", "grad_norm", "optimizer_steps", "time/iteration_s", "heldout/accuracy",
            "images_per_s"]
    hist = {k: {m.step: m.value for m in c.get_metric_history(info["run_id"], k)} for k in keys}
    steps = sorted(hist["reward/reward/mean"])
    with (out_dir / "reward_curve.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["iteration", *keys])
        for s in steps:
            w.writerow([s, *[hist[k].get(s, "") for k in keys]])
    r = np.array([hist["reward/reward/mean"][s] for s in steps])
    q = max(1, len(r) // 10)
    summary["reward_first_10pct"] = float(r[:q].mean())
    summary["reward_last_10pct"] = float(r[-q:].mean())
    summary["optimizer_updates"] = int(sum(hist["optimizer_steps"].values()))
    summary["iteration_compute_s"] = float(sum(hist["time/iteration_s"].values()))  # excludes any downtime
    summary["heldout_curve"] = {int(k): v for k, v in sorted(hist["heldout/accuracy"].items())}
    summary["iterations_done"] = len(steps)
    summary["seconds_per_iteration"] = float(np.mean(list(hist["time/iteration_s"].values())))
    summary["images_per_s"] = float(np.mean(list(hist["images_per_s"].values())))
    if summary["heldout_curve"]:  # the periodic evaluations inside the run (run.eval_every)
        best = max(summary["heldout_curve"].items(), key=lambda kv: (kv[1], -kv[0]))
        summary["heldout_best"], summary["heldout_best_iteration"] = best[1], best[0]
    run = c.get_run(info["run_id"])
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # the resolved config exactly as logged to MLflow
        shutil.copy(c.download_artifacts(info["run_id"], "config/resolved.yaml", tmp), out_dir / "config.yaml")

    from safetensors.torch import load_file

    ck = sorted((wd / "checkpoints" / a.name / info["run_id"]).glob("it_*"))[-1]
    new = load_file(str(ck / "trainable.safetensors"))
    import yaml

    from pixrl.engines.assets import resolve_asset

    model = yaml.safe_load((out_dir / "config.yaml").read_text())["model"]
    weights = "model.safetensors" if model["family"] == "janus_pro" else "transformer/diffusion_pytorch_model.safetensors"
    base = load_file(str(resolve_asset(model["path"]) / weights))
    diff = sum(float((new[k].float() - base[k].float()).norm() ** 2) for k in new if k in base) ** 0.5
    norm = sum(float(base[k].float().norm() ** 2) for k in new if k in base) ** 0.5
    summary["weight_change_rel_l2"] = diff / norm
    summary["mlflow_status"] = run.info.status

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot(steps, r, lw=0.8, label="reward (mean)")
    if len(r) >= 10:
        k = np.ones(10) / 10
        ax[0].plot(steps[9:], np.convolve(r, k, mode="valid"), lw=2, label="10-it moving avg")
    ax[0].set_xlabel("iteration"); ax[0].set_ylabel("train reward"); ax[0].legend()
    if hist["heldout/accuracy"]:
        hs = sorted(hist["heldout/accuracy"])
        ax[1].plot(hs, [hist["heldout/accuracy"][s] for s in hs], marker="o")
        ax[1].set_xlabel("iteration"); ax[1].set_ylabel("held-out accuracy (in-run eval)")
    else:
        zs = [hist["zero_std_ratio"].get(s, np.nan) for s in steps]
        ax[1].plot(steps, zs, lw=0.8, color="gray"); ax[1].set_xlabel("iteration"); ax[1].set_ylabel("zero_std_ratio")
    fig.suptitle(f"{a.name}: held-out {summary['heldout_before']:.3f} → {summary['heldout_after']:.3f}")
    fig.tight_layout()
    fig.savefig(out_dir / "reward_curve.png", dpi=110)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if not k.endswith("_detail")}, indent=2))


if __name__ == "__main__":
    main()
