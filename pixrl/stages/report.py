"""Reward statistics of a scored iteration, per component and per prompt category (the Prefect
UI's reward table)."""

from __future__ import annotations

import json

import numpy as np

from ..artifacts.trajectories import TrajectoryStore


def _row(group: str, name: str, v: np.ndarray) -> dict:
    return {"group": group, "name": name, "n": int(v.size), "mean": round(float(v.mean()), 4),
            "std": round(float(v.std()), 4), "min": round(float(v.min()), 4), "max": round(float(v.max()), 4)}


def reward_report(table: TrajectoryStore, run_id: str, iteration: int) -> list[dict]:
    t = table.dataset().to_table(columns=["rewards", "reward", "prompt_meta"],
                                 filter=f"run_id = '{run_id}' AND iteration = {int(iteration)}")
    comps: dict[str, list[float]] = {}
    for items in t["rewards"].to_pylist():
        for item in items or []:
            comps.setdefault(item["name"], []).append(item["value"])
    total = t["reward"].to_numpy(zero_copy_only=False)
    rows = [_row("component", name, np.asarray(vals, np.float64))
            for name, vals in [("reward (total)", total), *sorted(comps.items())]]
    cats = np.array([json.loads(m).get("category") or "—" for m in t["prompt_meta"].to_pylist()])
    rows += [_row("category", cat, total[cats == cat].astype(np.float64)) for cat in sorted(set(cats))]
    return rows
