"""Records an offline DPO (or SFT) run under docs/runs/<name>/: the resolved config, the loss /
implicit accuracy curve (CSV + PNG; SFT has the loss only), and summary.json with heldout_before / heldout_after, pair counts and
the lineage (sources pinned to Lance versions), all read back from MLflow.

    .venv/bin/python benchmarks/record_dpo.py --workdir /tmp/dpo1 --run shapes_dpo_from_grpo --name shapes_dpo_from_grpo
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--name", required=True, help="docs/runs/<name>")
    a = ap.parse_args()
    from pixrl.artifacts.export import export_run
    from pixrl.artifacts.tracking import Tracker, default_tracking_uri

    out = ROOT / "docs" / "runs" / a.name
    out.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(default_tracking_uri(Path(a.workdir)))
    run_id = tracker.find_run("pixrl.run_name", a.run)
    export_run(tracker, run_id, out)
    run = tracker.client.get_run(run_id)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(tracker.client.download_artifacts(run_id, "config/resolved.yaml", tmp), out / "config.yaml")
        ev = json.loads(Path(tracker.client.download_artifacts(run_id, "evaluation.json", tmp)).read_text())
    m, tags = run.data.metrics, run.data.tags
    summary = {
        "name": a.name, "mlflow_run_id": run_id, "status": run.info.status,
        "heldout_before": ev["heldout_before"], "heldout_after": ev["heldout_after"],
        "heldout_lift": ev["heldout_after"] - ev["heldout_before"],
        "heldout_before_detail": ev["before"], "heldout_after_detail": ev["after"],
        "pairs": m.get("pairs"), "pair_groups": m.get("pair_groups"), "selected_rows": m.get("selected_rows"),
        "pair_reward_margin": m.get("pair_reward_margin"),
        "update_compute_s": m.get("update_compute_s"), "duration_s": (run.info.end_time - run.info.start_time) / 1000,
        "sources": json.loads(tags["pixrl.dpo.sources"]), "filters": json.loads(tags["pixrl.dpo.filters"]),
    }
    import csv

    rows = list(csv.DictReader((out / "dpo_curve.csv").open()))
    steps = np.array([int(r["step"]) for r in rows])
    loss = np.array([float(r["dpo_loss"]) for r in rows])
    dpo = all(r["dpo_implicit_acc"] != "" for r in rows)  # SFT logs no implicit accuracy
    acc = np.array([float(r["dpo_implicit_acc"]) for r in rows]) if dpo else None
    summary["algorithm"] = tags.get("pixrl.algorithm")
    summary["optimizer_steps"] = int(len(steps))
    summary["loss_first"], summary["loss_last_10pct"] = float(loss[0]), float(loss[-max(1, len(loss) // 10):].mean())
    if dpo:
        summary["implicit_acc_last_10pct"] = float(acc[-max(1, len(acc) // 10):].mean())
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = np.ones(20) / 20
    fig, ax = plt.subplots(1, 2 if dpo else 1, figsize=(10 if dpo else 5.5, 3.5), squeeze=False)
    ax = ax[0]
    ax[0].plot(steps, loss, lw=0.6, color="lightgray")
    if len(loss) >= 20:
        ax[0].plot(steps[19:], np.convolve(loss, k, mode="valid"), lw=2, label="20-step mean")
    if dpo:
        ax[0].axhline(np.log(2), ls="--", color="k", lw=0.8, label="ln 2")
    ax[0].set_xlabel("step"); ax[0].set_ylabel("DPO loss" if dpo else "loss"); ax[0].legend()
    if dpo:
        ax[1].plot(steps, acc, lw=0.6, color="lightgray")
        if len(acc) >= 20:
            ax[1].plot(steps[19:], np.convolve(acc, k, mode="valid"), lw=2)
        ax[1].set_xlabel("step"); ax[1].set_ylabel("implicit accuracy")
    fig.suptitle(f"{a.name}: held-out {ev['heldout_before']:.3f} → {ev['heldout_after']:.3f} "
                 f"({int(m.get('pairs', 0))} pairs)", fontsize=11 if dpo else 8)
    fig.tight_layout()
    fig.savefig(out / "dpo_curve.png", dpi=110)
    print(json.dumps({k: v for k, v in summary.items() if not k.endswith("_detail")}, indent=2))


if __name__ == "__main__":
    main()
