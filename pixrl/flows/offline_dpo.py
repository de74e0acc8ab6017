"""Offline preference training from archived rollouts: select → pair → update → publish →
evaluate, one MLflow run with lineage tags (source runs, Lance URIs + pinned versions, filters,
pair count). Rerunning the flow for the same run (resume, Prefect retry) skips stored stages."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow, task
from prefect.runtime import flow_run

from ..artifacts.archive import PinnedTable, resolve_sources
from ..artifacts.tracking import Tracker, default_tracking_uri
from ..config.loader import flatten
from ..config.schema import ExperimentConfig
from ..engines.local import RunSpec
from ..engines.offline import check_selection
from ..tasks import dpo as stages
from .online import comparison_tags, recorded_model_name, run_spec


@task(name="open-dpo-run", persist_result=False)
def open_dpo_run(config: dict, workdir: str, resume_run_id: str | None = None) -> tuple[RunSpec, list[dict]]:
    """Pin the sources (or read the pinned ones back when resuming) and create/reattach the run."""
    cfg = ExperimentConfig.model_validate(config)
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(cfg.run.tracking_uri or default_tracking_uri(wd))
    fr_id = str(flow_run.get_id() or "")
    existing = resume_run_id or (tracker.find_run("prefect.flow_run_id", fr_id) if fr_id else None)
    if existing:
        tracker.reopen(existing, {"prefect.last_flow_run_id": fr_id})
        pinned = json.loads(tracker.client.get_run(existing).data.tags["pixrl.dpo.sources"])
        return run_spec(cfg, wd, existing, recorded_model_name(tracker, existing)), pinned
    tables = resolve_sources(cfg.dpo.source, tracker)
    check_selection(tables, cfg.dpo)  # empty selections and all-tied groups fail before the run exists
    pinned = [t.to_dict() for t in tables]
    source_runs = sorted({r for t in tables for r in (t.run_ids or ())})
    tags = {**comparison_tags(cfg), "pixrl.algorithm": "diffusion_dpo", "prefect.flow_run_id": fr_id,
            "pixrl.dpo.sources": json.dumps(pinned), "pixrl.dpo.source_run_ids": ",".join(source_runs),
            "pixrl.dpo.tables": ",".join(t.ref for t in tables),
            "pixrl.dpo.filters": json.dumps(cfg.dpo.model_dump(mode="json", exclude={"source"}))}
    run_id = tracker.start_run(cfg.run.experiment, cfg.run.name, tags)
    tracker.log_params(run_id, flatten(cfg))
    tracker.log_dict(run_id, cfg.model_dump(mode="json"), "config/resolved.yaml")
    spec = run_spec(cfg, wd, run_id)
    tracker.set_tags(run_id, {"pixrl.model_name": spec.model_name})
    return spec, pinned


@flow(name="pixrl-offline-dpo")
def offline_dpo(config: dict, workdir: str = "work", resume_run_id: str | None = None) -> dict:
    """Diffusion-DPO on preference pairs mined from archived rollouts; returns where results are."""
    cfg = ExperimentConfig.model_validate(config)
    spec, pinned = open_dpo_run(cfg.model_dump(mode="json"), workdir, resume_run_id)
    tracker = Tracker(spec.tracking_uri)
    try:
        sel = stages.select(spec, pinned)
        pairs_uri = stages.pair(spec, sel)
        ckpt = stages.update(spec, pairs_uri)
        policy = stages.publish(spec, ckpt)
        ev = stages.evaluate(spec, ckpt, policy)
    except BaseException:
        tracker.end_run(spec.run_id, "FAILED")
        raise
    n_pairs = int(tracker.client.get_run(spec.run_id).data.metrics.get("pairs", 0))
    tracker.set_tags(spec.run_id, {"pixrl.dpo.pairs": str(n_pairs)})
    tracker.end_run(spec.run_id)
    return {"run_id": spec.run_id, "tracking_uri": spec.tracking_uri, "model_name": spec.model_name,
            "policy": policy, "pairs_uri": pairs_uri, "sources": [PinnedTable.from_dict(p).ref for p in pinned],
            "heldout_before": ev["heldout_before"], "heldout_after": ev["heldout_after"],
            "workdir": spec.workdir, "flow_run_id": str(flow_run.get_id() or "")}
