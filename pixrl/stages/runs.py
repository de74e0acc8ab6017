"""Opening a run, shared by every flow (online, rollouts, offline DPO): create the MLflow run
(params = flattened config, comparison tags, the resolved config as an artifact), or reattach
to it — when resuming, and when Prefect retries the same flow run."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from ..artifacts.tracking import Tracker, default_tracking_uri
from ..config.loader import flatten
from ..config.schema import ExperimentConfig
from ..engines.assets import resolve_asset
from ..run import RunSpec, run_spec


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _file_digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        return "none"


def comparison_tags(cfg: ExperimentConfig) -> dict[str, str]:
    """The tags every pixrl run carries, so runs line up in MLflow's comparison views."""
    return {"pixrl.family": cfg.model.family, "pixrl.reward": ",".join(cfg.reward.weights),
            "pixrl.run_name": cfg.run.name, "pixrl.dataset": cfg.dataset.name,
            "pixrl.dataset_version": _file_digest(resolve_asset(cfg.dataset.path)),
            "git.commit": _git_commit(), "dvc.lock_sha256": _file_digest(Path("dvc.lock"))}


def recorded_model_name(tracker: Tracker, run_id: str) -> str | None:
    """The registered model an existing run publishes to (its `pixrl.model_name` tag)."""
    return tracker.client.get_run(run_id).data.tags.get("pixrl.model_name")


def tracker_for(cfg: ExperimentConfig, workdir: Path) -> Tracker:
    return Tracker(cfg.run.tracking_uri or default_tracking_uri(Path(workdir).resolve()))


def existing_run(tracker: Tracker, flow_run_id: str, resume_run_id: str | None) -> str | None:
    """The run to reattach to: the one being resumed, or the one this flow run already opened."""
    return resume_run_id or (tracker.find_run("prefect.flow_run_id", flow_run_id) if flow_run_id else None)


def reopen_run(cfg: ExperimentConfig, workdir: Path, tracker: Tracker, run_id: str, flow_run_id: str) -> RunSpec:
    tracker.reopen(run_id, {"prefect.last_flow_run_id": flow_run_id})
    return run_spec(cfg, workdir, run_id, recorded_model_name(tracker, run_id))


def start_run(cfg: ExperimentConfig, workdir: Path, tracker: Tracker, flow_run_id: str, algorithm: str,
              tags: dict[str, str] | None = None, trajectories: bool = True) -> RunSpec:
    """A new MLflow run with the comparison tags, params and resolved config; then its spec.
    `trajectories`: the run writes a trajectory table (its URI is tagged for status/lineage)."""
    all_tags = {**comparison_tags(cfg), "pixrl.algorithm": algorithm, "prefect.flow_run_id": flow_run_id,
                **(tags or {})}
    run_id = tracker.start_run(cfg.run.experiment, cfg.run.name, all_tags)
    tracker.log_params(run_id, flatten(cfg))
    tracker.log_dict(run_id, cfg.model_dump(mode="json"), "config/resolved.yaml")
    spec = run_spec(cfg, workdir, run_id)
    tracker.set_tags(run_id, {**({"pixrl.table_uri": spec.table_uri} if trajectories else {}),
                              "pixrl.model_name": spec.model_name})
    return spec


def fork_tags(fork: dict) -> dict[str, str]:
    """Lineage of a fork: where it branched off, and the exact Lance version it read."""
    import json

    return {"pixrl.fork": json.dumps(fork), "pixrl.parent_run_id": fork["parent_run_id"],
            "pixrl.parent_run_name": fork["parent_run_name"], "pixrl.fork_iteration": str(fork["iteration"]),
            "pixrl.fork_stage": fork["from_stage"], "pixrl.parent_table_uri": fork["parent_table_uri"],
            "pixrl.parent_table_version": str(fork["parent_table_version"]), "mlflow.parentRunId": fork["parent_run_id"]}
