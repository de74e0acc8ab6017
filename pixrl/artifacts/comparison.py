"""One row per run for comparing experiments in the terminal (`pixrl runs`): final and best
train reward, held-out accuracy (last and best), throughput, duration and status, all read back
from MLflow, so online and offline runs line up the same way."""

from __future__ import annotations

from dataclasses import dataclass

from .tracking import Tracker


@dataclass
class RunRow:
    name: str
    run_id: str
    algorithm: str
    status: str
    iterations: int | None
    final_reward: float | None
    best_reward: float | None
    heldout: float | None  # last held-out accuracy
    best_heldout: float | None
    images_per_s: float | None
    duration_s: float | None
    git_commit: str


def _hist(tracker: Tracker, run_id: str, key: str) -> list:
    return sorted(tracker.client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))


def list_runs(tracker: Tracker, experiment: str | None = None) -> list[RunRow]:
    exps = tracker.client.search_experiments()
    ids = [e.experiment_id for e in exps if experiment is None or e.name == experiment]
    if not ids:
        return []
    rows = []
    for r in tracker.client.search_runs(ids, filter_string="tags.`pixrl.run_name` != ''",
                                        order_by=["attributes.start_time ASC"]):
        rid, tags = r.info.run_id, r.data.tags
        reward = _hist(tracker, rid, "reward/reward/mean")
        held = _hist(tracker, rid, "heldout/accuracy")
        ips = [m.value for m in _hist(tracker, rid, "images_per_s")]
        end = r.info.end_time or None
        rows.append(RunRow(
            name=tags["pixrl.run_name"], run_id=rid, algorithm=tags.get("pixrl.algorithm", "?"), status=r.info.status,
            iterations=(reward[-1].step + 1) if reward else None,
            final_reward=reward[-1].value if reward else None,
            best_reward=max(m.value for m in reward) if reward else None,
            heldout=held[-1].value if held else None, best_heldout=max(m.value for m in held) if held else None,
            images_per_s=sum(ips) / len(ips) if ips else None,
            duration_s=(end - r.info.start_time) / 1000 if end else None,
            git_commit=tags.get("git.commit", "")[:8]))
    return rows
