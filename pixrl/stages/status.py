"""What the stores say about a run (`pixrl status`): per iteration, which stages are complete
and their refs, by the completion table of stages/completion.py, read in one scan per store."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.compute as pc

from ..artifacts.checkpoints import CorruptCheckpoint, verify_checkpoint
from ..artifacts.tracking import Tracker
from ..artifacts.trajectories import TrajectoryStore
from ..run import RunLayout
from .completion import FILLED_BY, columns_complete


@dataclass
class IterationStatus:
    iteration: int
    stages: dict[str, str | None] = field(default_factory=dict)  # stage -> reference, None = not done


def run_status(workdir: Path, run_name: str, tracking_uri: str) -> tuple[str | None, list[IterationStatus]]:
    tracker = Tracker(tracking_uri)
    run_id = tracker.find_run("pixrl.run_name", run_name)
    if run_id is None:
        return None, []
    run = tracker.client.get_run(run_id)
    store = TrajectoryStore(run.data.tags.get("pixrl.table_uri", ""))
    versions = {}
    for mv in tracker.run_versions(run.data.tags.get("pixrl.model_name", ""), run_id):  # not the whole experiment's
        versions[int(mv.tags.get("iteration", -1))] = f"v{mv.version}"
    its: dict[int, IterationStatus] = {}
    if store.exists():
        cols = sorted({c for cs in FILLED_BY.values() for c in cs})
        t = store.dataset().to_table(columns=["iteration", *cols], filter=f"run_id = '{run_id}'")
        for it in sorted(set(t["iteration"].to_pylist())):
            rows = t.filter(pc.equal(t["iteration"], it))
            st = IterationStatus(it)
            st.stages["generate"] = f"{rows.num_rows} rows"
            for stage in FILLED_BY:
                st.stages[stage] = "done" if columns_complete(rows, stage) else None
            its[it] = st
    ck_root = RunLayout(Path(workdir), run_name, run_id).checkpoints
    for d in sorted(ck_root.glob("it_*")) if ck_root.exists() else []:
        it = int(d.name.split("_")[1])
        st = its.setdefault(it, IterationStatus(it))
        try:
            verify_checkpoint(d)
            st.stages["update"] = str(d)
        except CorruptCheckpoint:
            st.stages["update"] = None
    for it, v in versions.items():
        its.setdefault(it, IterationStatus(it)).stages["publish"] = v
    return run_id, [its[k] for k in sorted(its)]
