"""Archive rollouts of a fixed policy without training: each iteration runs the generate →
decode → score tasks of the online loop and stops. The rows are the same as an RL run's
(latents, log-probs, seeds, images, rewards, sampler recipe, policy version), so offline
training (`pixrl dpo --from RUN`) mines them like any other archive — e.g. preference pairs
drawn from the base model itself, the on-policy data Diffusion-DPO assumes."""

from __future__ import annotations

from pathlib import Path

from mlflow.exceptions import MlflowException
from prefect import flow
from prefect.runtime import flow_run

from ..artifacts.run_lock import RunLock
from ..artifacts.tracking import PolicyRef, Tracker, default_tracking_uri, policy_model_name
from ..config.schema import ExperimentConfig
from ..errors import ExpectedError
from ..stages.preflight import preflight
from ..tasks.report import report_iteration, start_progress
from ..tasks.retry import with_retries
from ..tasks.stages import decode, generate, score
from .interrupts import end_status
from .online import open_run
from .api_server import yield_to_compute


class RolloutsError(ExpectedError, ValueError):
    """A policy to archive that the registry does not have."""


def rollout_iteration(spec, iteration: int, policy: dict) -> dict:
    """One batch of groups from `policy`, decoded and scored, as three tasks of the calling flow
    run (no subflow per iteration: see flows/online.py); returns the table reference."""
    run = spec.cfg.run
    t = {f.name: with_retries(f, run).with_options(task_run_name=f"{f.name}[it={iteration}]")
         for f in (generate, decode, score)}
    table = t["generate"](spec, iteration, policy)
    table = t["decode"](spec, iteration, table)
    return t["score"](spec, iteration, table)


def _policy(cfg: ExperimentConfig, workdir: str, version: int) -> PolicyRef:
    name = policy_model_name(cfg.run.experiment)
    if version == 0:
        return PolicyRef(name, 0)
    uri = cfg.run.tracking_uri or default_tracking_uri(Path(workdir).resolve())
    try:
        return Tracker(uri).version(name, version)
    except MlflowException:
        raise RolloutsError(f"models:/{name}/{version} is not registered in {uri}; the registry lists its "
                            f"versions (mlflow ui --backend-store-uri {uri}); version 0 archives the base weights") from None


@flow(name="pixrl-rollouts")
def rollouts(config: dict, workdir: str = "work", policy_version: int = 0,
             resume_run_id: str | None = None) -> dict:
    """`run.iterations` batches of rollouts from one policy version of the experiment's
    registered model (0 = the base weights). Like training, every stage skips output the stores
    already hold, so a resumed run redoes only what is missing."""
    cfg = ExperimentConfig.model_validate(config)
    preflight(cfg)
    policy = _policy(cfg, workdir, policy_version)  # before the run exists: a bad version writes nothing
    with RunLock(workdir, cfg.run.name):
        return _rollouts(cfg, workdir, policy, resume_run_id)


def _rollouts(cfg: ExperimentConfig, workdir: str, policy: PolicyRef, resume_run_id: str | None) -> dict:
    spec = open_run(cfg.model_dump(mode="json"), workdir, resume_run_id)
    tracker = Tracker(spec.tracking_uri)
    tracker.set_tags(spec.run_id, {"pixrl.mode": "rollouts", "pixrl.policy_version": str(policy.version)})
    progress_id = start_progress(spec)
    yield_to_compute()  # the run's API-heavy opening is over; the server's background work now yields
    try:
        for it in range(cfg.run.iterations):
            rollout_iteration(spec, it, policy.to_dict())
            report_iteration.with_options(task_run_name=f"report[it={it}]")(spec, it, progress_id, cfg.run.iterations)
    except BaseException as exc:
        tracker.end_run(spec.run_id, end_status(exc))
        raise
    tracker.end_run(spec.run_id)
    return {"run_id": spec.run_id, "tracking_uri": spec.tracking_uri, "table_uri": spec.table_uri,
            "model_name": spec.model_name, "policy": policy.to_dict(), "workdir": spec.workdir,
            "flow_run_id": str(flow_run.get_id() or "")}
