"""Offline preference training from archived rollouts: select → pair → update → publish →
evaluate, one MLflow run with lineage tags (source runs, Lance URIs + pinned versions, filters,
pair count). Rerunning the flow for the same run (resume, Prefect retry) skips stored stages."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow, task
from prefect.runtime import flow_run

from ..algorithms.base import build_algorithm
from ..artifacts.archive import PinnedTable, resolve_sources
from ..artifacts.run_lock import RunLock
from ..artifacts.store_maintenance import pin_version
from ..artifacts.trajectories import TrajectoryStore
from ..config.schema import ExperimentConfig
from ..models.registry import get_family
from ..run import RunSpec
from ..stages.offline import check_selection
from ..stages.runs import existing_run, reopen_run, start_run, tracker_for
from ..stages.session import release_workers
from ..tasks import dpo as stages
from .interrupts import end_status
from .api_server import yield_to_compute


@task(name="open-dpo-run", persist_result=False)
def open_dpo_run(config: dict, workdir: str, resume_run_id: str | None = None) -> tuple[RunSpec, list[dict]]:
    """Pin the sources (or read the pinned ones back when resuming) and create/reattach the run."""
    cfg = ExperimentConfig.model_validate(config)
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    tracker = tracker_for(cfg, wd)
    fr_id = str(flow_run.get_id() or "")
    existing = existing_run(tracker, fr_id, resume_run_id)
    if existing:
        pinned = json.loads(tracker.client.get_run(existing).data.tags["pixrl.dpo.sources"])
        return reopen_run(cfg, wd, tracker, existing, fr_id), pinned
    tables = resolve_sources(cfg.dpo.source, tracker)
    needs = build_algorithm(cfg.algorithm).needs
    family = get_family(cfg.model.family)
    if getattr(family, "needs_images", False):  # an editing-only family trains on its sources
        needs = needs | {"source_image"}
    check_selection(tables, cfg.dpo, needs, family)  # bad sources, no rows or pairs, mixed guidance: before the run
    for t in tables:  # the versions read stay readable through the source runs' store cleanups
        pin_version(TrajectoryStore(t.uri), t.version, f"dpo-{cfg.run.name}-v{t.version}")
    pinned = [t.to_dict() for t in tables]
    source_runs = sorted({r for t in tables for r in (t.run_ids or ())})
    tags = {"pixrl.dpo.sources": json.dumps(pinned), "pixrl.dpo.source_run_ids": ",".join(source_runs),
            "pixrl.dpo.tables": ",".join(t.ref for t in tables),
            "pixrl.dpo.filters": json.dumps(cfg.dpo.model_dump(mode="json", exclude={"source"}))}
    return start_run(cfg, wd, tracker, fr_id, cfg.algorithm.name, tags, trajectories=False), pinned


@flow(name="pixrl-offline-dpo")
def offline_dpo(config: dict, workdir: str = "work", resume_run_id: str | None = None) -> dict:
    """Offline DPO (Diffusion-DPO, or token DPO for a token family) on preference pairs mined from
    archived rollouts; returns where results are."""
    cfg = ExperimentConfig.model_validate(config)
    with RunLock(workdir, cfg.run.name):
        try:
            return _offline_dpo(cfg, workdir, resume_run_id)
        finally:
            release_workers()


def _offline_dpo(cfg: ExperimentConfig, workdir: str, resume_run_id: str | None) -> dict:
    spec, pinned = open_dpo_run(cfg.model_dump(mode="json"), workdir, resume_run_id)
    tracker = tracker_for(cfg, Path(spec.workdir))
    yield_to_compute()  # the run's API-heavy opening is over; the server's background work now yields
    try:
        sel = stages.select(spec, pinned)
        pairs_uri = stages.pair(spec, sel)
        ckpt = stages.update(spec, pairs_uri)
        policy = stages.publish(spec, ckpt)
        ev = stages.evaluate(spec, ckpt, policy)
    except BaseException as exc:
        tracker.end_run(spec.run_id, end_status(exc))
        raise
    n_pairs = int(tracker.client.get_run(spec.run_id).data.metrics.get("pairs", 0))
    tracker.set_tags(spec.run_id, {"pixrl.dpo.pairs": str(n_pairs)})
    tracker.end_run(spec.run_id)
    return {"run_id": spec.run_id, "tracking_uri": spec.tracking_uri, "model_name": spec.model_name,
            "policy": policy, "pairs_uri": pairs_uri, "sources": [PinnedTable.from_dict(p).ref for p in pinned],
            "heldout_before": ev["heldout_before"], "heldout_after": ev["heldout_after"],
            **({"not_evaluated": ev["not_evaluated"]} if "not_evaluated" in ev else {}),
            "workdir": spec.workdir, "flow_run_id": str(flow_run.get_id() or "")}
