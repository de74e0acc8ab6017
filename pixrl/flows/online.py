"""The online RL loop: `train` runs N iterations; each is one `rl_iteration` flow of six tasks
(generate → decode → score → replay → update → publish) that pass references, never tensors."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from prefect import flow, task
from prefect.runtime import flow_run

from ..artifacts.tracking import PolicyRef, Tracker, default_tracking_uri, policy_model_name
from ..artifacts.trajectories import TrajectoryStore
from ..config.loader import flatten
from ..config.schema import STAGES, ExperimentConfig  # noqa: F401  (STAGES re-exported)
from ..engines import progress
from ..engines.lineage import seed_fork_rows
from ..engines.local import RunSpec
from ..engines.preflight import preflight
from ..tasks.decode import decode
from ..tasks.evaluate import evaluate
from ..tasks.generate import generate
from ..tasks.publish import publish
from ..tasks.replay import replay
from ..tasks.report import report_iteration, start_progress, update_progress
from ..tasks.retry import with_retries
from ..tasks.score import score
from ..tasks.update import update


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _file_digest(path: Path) -> str:
    import hashlib

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        return "none"


def comparison_tags(cfg: ExperimentConfig) -> dict[str, str]:
    """The tags every pixrl run carries, so runs line up in MLflow's comparison views."""
    from ..engines.assets import resolve_asset

    return {"pixrl.family": cfg.model.family, "pixrl.reward": ",".join(cfg.reward.weights),
            "pixrl.run_name": cfg.run.name, "pixrl.dataset": cfg.dataset.name,
            "pixrl.dataset_version": _file_digest(resolve_asset(cfg.dataset.path)),
            "git.commit": _git_commit(), "dvc.lock_sha256": _file_digest(Path("dvc.lock"))}


def recorded_model_name(tracker: Tracker, run_id: str) -> str | None:
    """The registered model an existing run publishes to (its `pixrl.model_name` tag)."""
    return tracker.client.get_run(run_id).data.tags.get("pixrl.model_name")


def table_uri(cfg: ExperimentConfig, workdir: Path) -> str:
    root = cfg.run.store_root or str((workdir / "lance").resolve())
    return f"{root.rstrip('/')}/{cfg.run.name}/trajectories.lance"


def run_spec(cfg: ExperimentConfig, workdir: Path, run_id: str, model_name: str | None = None) -> RunSpec:
    """Where a run's stores are, from its config, work directory and MLflow run id. The registered
    model is the experiment's (`<experiment>-policy`) unless the run recorded another one."""
    wd = Path(workdir).resolve()
    return RunSpec(config=cfg.model_dump(mode="json"), run_id=run_id, run_name=cfg.run.name, workdir=str(wd),
                   tracking_uri=cfg.run.tracking_uri or default_tracking_uri(wd), table_uri=table_uri(cfg, wd),
                   model_name=model_name or policy_model_name(cfg.run.experiment))


@task(name="open-run", persist_result=False)
def open_run(config: dict, workdir: str, resume_run_id: str | None = None, fork: dict | None = None) -> RunSpec:
    """Create the MLflow run (params = flattened config, tags, resolved config as an artifact), or
    reattach to it: when resuming, and when Prefect retries this same flow run."""
    cfg = ExperimentConfig.model_validate(config)
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    uri = cfg.run.tracking_uri or default_tracking_uri(wd)
    tracker = Tracker(uri)
    spec_of = lambda rid: run_spec(cfg, wd, rid)  # noqa: E731
    fr_id = str(flow_run.get_id() or "")
    existing = resume_run_id or (tracker.find_run("prefect.flow_run_id", fr_id) if fr_id else None)
    if existing:
        tracker.reopen(existing, {"prefect.last_flow_run_id": fr_id})
        return run_spec(cfg, wd, existing, recorded_model_name(tracker, existing))
    tags = {**comparison_tags(cfg), "pixrl.algorithm": cfg.algorithm.name,
            "prefect.flow_run_id": str(flow_run.get_id() or "")}
    if fork:  # lineage: where this run branched off, and the exact Lance version it read
        tags.update({"pixrl.fork": json.dumps(fork), "pixrl.parent_run_id": fork["parent_run_id"],
                     "pixrl.parent_run_name": fork["parent_run_name"], "pixrl.fork_iteration": str(fork["iteration"]),
                     "pixrl.fork_stage": fork["from_stage"], "pixrl.parent_table_uri": fork["parent_table_uri"],
                     "pixrl.parent_table_version": str(fork["parent_table_version"]),
                     "mlflow.parentRunId": fork["parent_run_id"]})
    run_id = tracker.start_run(cfg.run.experiment, cfg.run.name, tags)
    tracker.log_params(run_id, flatten(cfg))
    tracker.log_dict(run_id, cfg.model_dump(mode="json"), "config/resolved.yaml")
    spec = spec_of(run_id)
    tracker.set_tags(run_id, {"pixrl.table_uri": spec.table_uri, "pixrl.model_name": spec.model_name})
    return spec


@flow(name="pixrl-iteration")
def rl_iteration(spec: RunSpec, iteration: int, policy: dict) -> dict:
    """One RL iteration; returns the newly published policy reference. Each task retries
    transient faults as configured in run.retries; anything else fails the iteration at once."""
    run = spec.cfg.run
    label = f"[it={iteration}]"
    t = {f.name: with_retries(f, run).with_options(task_run_name=f"{f.name}{label}")
         for f in (generate, decode, score, replay, update, publish)}
    table = t["generate"](spec, iteration, policy)
    table = t["decode"](spec, iteration, table)
    table = t["score"](spec, iteration, table)
    replayed = t["replay"](spec, iteration, table)
    ckpt = t["update"](spec, iteration, replayed, policy)
    return t["publish"](spec, iteration, ckpt)


@task(name="seed-fork", persist_result=False)
def seed_fork(spec: RunSpec, fork: dict) -> None:
    """Copy the parent's outputs of the stages before the fork point into this run's table."""
    seed_fork_rows(TrajectoryStore(fork["parent_table_uri"]), fork["parent_run_id"], fork["parent_table_version"],
                   fork["iteration"], fork["from_stage"], TrajectoryStore(spec.table_uri), spec.run_id)


@flow(name="pixrl-train")
def train(config: dict, workdir: str = "work", resume_run_id: str | None = None, fork: dict | None = None) -> dict:
    """Run `run.iterations` RL iterations from the base weights; returns where the results are.

    Every stage first asks the stores whether its output for (run, iteration) is committed and
    skips if so; resuming a run (or Prefect retrying this flow run) therefore redoes only the
    failed stage and what follows, with the same MLflow run. A fork (`pixrl replay --into`)
    starts at fork.iteration from the parent's policy, reusing the parent's earlier stages."""
    cfg = ExperimentConfig.model_validate(config)
    preflight(cfg)
    spec = open_run(cfg.model_dump(mode="json"), workdir, resume_run_id, fork)
    tracker = Tracker(spec.tracking_uri)
    policy = PolicyRef(spec.model_name, 0).to_dict()
    start = 0
    if fork:
        seed_fork(spec, fork)
        policy, start = fork["policy"], fork["iteration"]
    every = cfg.run.eval_every if cfg.dataset.name == "shapes" else 0
    progress_id = start_progress(spec)
    try:
        if every and start == 0:
            evaluate.with_options(task_run_name="evaluate[after=0]")(spec, 0, policy)
        for it in range(start, cfg.run.iterations):
            progress.clear(spec.run_id, it)
            done = tracker.find_version(spec.model_name, spec.run_id, it)
            if done is not None:  # resume: the iteration is published, so every stage of it is committed
                tracker.move_alias(done)  # a crash may have come between registration and the alias move
                tracker.log_missing_metrics(spec.run_id, {"policy_version": done.version}, step=it)
                for stage in STAGES:
                    progress.skipped(it, stage)
                policy = done.to_dict()
            else:
                t0 = time.perf_counter()
                policy = rl_iteration(spec, it, policy)
                wall = time.perf_counter() - t0  # includes the subflow's own Prefect bookkeeping
                stage_s = progress.stage_seconds(spec.run_id, it)
                if stage_s:  # an iteration found complete in the stores logs nothing again
                    tracker.log_metrics(spec.run_id, {"time/iteration_s": wall,
                                                      "orchestration_overhead": 1.0 - sum(stage_s.values()) / wall},
                                        step=it)
                report_iteration.with_options(task_run_name=f"report[it={it}]")(spec, it)
            update_progress(progress_id, it + 1, cfg.run.iterations)
            if every and ((it + 1) % every == 0 or it + 1 == cfg.run.iterations):
                evaluate.with_options(task_run_name=f"evaluate[after={it + 1}]")(spec, it + 1, policy)
    except BaseException:
        tracker.end_run(spec.run_id, "FAILED")
        raise
    tracker.end_run(spec.run_id)
    return {"run_id": spec.run_id, "tracking_uri": spec.tracking_uri, "table_uri": spec.table_uri,
            "model_name": spec.model_name, "policy": policy, "workdir": spec.workdir,
            "flow_run_id": str(flow_run.get_id() or "")}
