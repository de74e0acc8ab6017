"""Small pointer and metric files for pipelines that track files (DVC): where a run's results
live (MLflow run id, Lance URI + version, registered model version) and its headline metrics and
curves. The stores stay where they are; only these files are versioned by DVC."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lance

from .files import write_text_atomic as _write
from .tracking import Tracker




def _curve(path: Path, tracker: Tracker, run_id: str, keys: list[str], index: str) -> list[dict]:
    hist = {k: {m.step: m.value for m in tracker.client.get_metric_history(run_id, k)} for k in keys}
    steps = sorted(set().union(*[set(h) for h in hist.values()]))
    rows = [{index: s, **{k.replace("/", "_"): hist[k].get(s, "") for k in keys}} for s in steps]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[index, *[k.replace("/", "_") for k in keys]])
        w.writeheader()
        w.writerows(rows)
    return rows


def export_run(tracker: Tracker, run_id: str, out_dir: Path) -> dict:
    """ref.json + metrics.json + a curve CSV for an online (reward_curve.csv) or DPO run (dpo_curve.csv)."""
    run = tracker.client.get_run(run_id)
    tags, metrics = run.data.tags, run.data.metrics
    model = tags.get("pixrl.model_name")
    latest = tracker.latest_of_run(model, run_id) if model else None  # this run's, not the experiment's alias
    best = tracker.champion_of_run(model, run_id) if model else None
    ref = {"run_id": run_id, "run_name": tags.get("pixrl.run_name"), "tracking_uri": tracker.uri,
           "experiment_id": run.info.experiment_id, "algorithm": tags.get("pixrl.algorithm"),
           "model": model, "model_version": latest.version if latest else None,
           "best_model_version": best.version if best else None, "git_commit": tags.get("git.commit")}
    out: dict = {}
    if "pixrl.table_uri" in tags:  # online
        uri = tags["pixrl.table_uri"]
        ref.update(table_uri=uri, table_version=lance.dataset(uri).version)
        rows = _curve(out_dir / "reward_curve.csv", tracker, run_id,
                      ["reward/reward/mean", "heldout/accuracy"], "iteration")
        rewards = [r["reward_reward_mean"] for r in rows if r["reward_reward_mean"] != ""]
        q = max(1, len(rewards) // 10)
        out.update(iterations=len(rewards), reward_final=rewards[-1] if rewards else None,
                   reward_first_10pct=sum(rewards[:q]) / q if rewards else None,
                   reward_last_10pct=sum(rewards[-q:]) / q if rewards else None)
        held = tracker.client.get_metric_history(run_id, "heldout/accuracy")
        if held:
            held = sorted(held, key=lambda m: m.step)
            out.update(heldout_before=held[0].value, heldout_after=held[-1].value,
                       heldout_best=max(m.value for m in held))
    else:  # offline DPO
        ref.update(sources=json.loads(tags.get("pixrl.dpo.sources", "[]")))
        _curve(out_dir / "dpo_curve.csv", tracker, run_id, ["dpo/loss", "dpo/implicit_acc"], "step")
        out.update(pairs=metrics.get("pairs"), heldout_before=metrics.get("heldout/accuracy_before"),
                   heldout_after=metrics.get("heldout/accuracy"), dpo_loss_final=metrics.get("dpo/loss"),
                   implicit_acc_final=metrics.get("dpo/implicit_acc"))
    _write(out_dir / "ref.json", json.dumps(ref, indent=2) + "\n")
    _write(out_dir / "metrics.json", json.dumps(out, indent=2) + "\n")
    return ref
