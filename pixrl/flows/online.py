"""The online RL loop: `train` runs N iterations; each is six tasks of the train flow run
(generate → decode → score → replay → update → publish, named `<stage>[it=N]`) that pass
references, never tensors. No task tags: a tagged task asks the API for concurrency slots
(≈2 s per task against the local server here).

Iterations are not subflows: on this machine a sync subflow costs 1.2–1.3 s of Prefect
bookkeeping (its tracking task, flow-run creation, state proposals and the heartbeat thread's
join) against ≈17 ms per task — 9% of a miniature iteration, which the pipeline/bare target of
issue 14 (≤ 1.05) cannot carry. benchmarks/prefect_overhead.py measures both."""

from __future__ import annotations

import gc
import time
from pathlib import Path

from prefect import flow, task
from prefect.runtime import flow_run

from ..algorithms.base import build_algorithm
from ..artifacts.run_lock import RunLock
from ..artifacts.tracking import PolicyRef
from ..artifacts.trajectories import TrajectoryStore
from ..config.schema import STAGES, ExperimentConfig
from ..datasets.registry import evaluates
from ..run import RunSpec
from ..stages import progress
from ..stages.completion import RunStores
from ..stages.lineage import seed_fork_rows
from ..stages.preflight import preflight
from ..stages.session import online_stages, release_workers
from ..stages.stored_policies import check_stored_policies
from ..stages.schedule import PolicySchedule
from ..stages.runs import existing_run, fork_tags, reopen_run, start_run, tracker_for
from ..tasks.report import report_iteration, start_progress, update_progress
from ..tasks.retry import with_retries
from ..tasks.stages import decode, evaluate, generate, publish, replay, score, update
from .interrupts import end_status
from .api_server import yield_to_compute


@task(name="open-run", persist_result=False)
def open_run(config: dict, workdir: str, resume_run_id: str | None = None, fork: dict | None = None) -> RunSpec:
    """Create the MLflow run, or reattach to it: when resuming, and when Prefect retries this
    same flow run."""
    cfg = ExperimentConfig.model_validate(config)
    wd = Path(workdir).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    tracker = tracker_for(cfg, wd)
    fr_id = str(flow_run.get_id() or "")
    existing = existing_run(tracker, fr_id, resume_run_id)
    check_stored_policies(build_algorithm(cfg.algorithm), cfg, tracker)  # a teacher exists and was trained alike
    if existing:
        return reopen_run(cfg, wd, tracker, existing, fr_id)
    return start_run(cfg, wd, tracker, fr_id, cfg.algorithm.name, fork_tags(fork) if fork else None)


def rl_iteration(spec: RunSpec, iteration: int, policy: dict, schedule: PolicySchedule | None = None) -> dict:
    """One RL iteration as six tasks of the calling flow run; returns the newly published policy
    reference. Each task retries transient faults as configured in run.retries; anything else
    fails the iteration at once. With dynamic sampling (sampling.max_rounds > 1) generate →
    decode → score repeat, one round of fresh groups at a time, while the stored rewards hold
    fewer groups with signal than the batch needs. `schedule` (run.staleness): which policy
    samples this iteration (`policy`, the update's, when None) — and, once this iteration's
    rollout is decoded, the next iteration's rollout begins on an engine with rollout workers."""
    run = spec.cfg.run
    t = {f.name: with_retries(f, run).with_options(task_run_name=f"{f.name}[it={iteration}]")
         for f in (generate, decode, score, replay, update, publish)}
    sampling = schedule.sampling(iteration) if schedule else policy
    ahead = (lambda: _prefetch_next(spec, iteration, schedule)) if schedule and schedule.staleness else None
    single = spec.cfg.sampling.max_rounds == 1
    table = _sampling_round(spec, iteration, sampling, 0, t, ahead if single else None)
    rnd = 1
    while online_stages(spec).needs_round(iteration, rnd):
        table = _sampling_round(spec, iteration, sampling, rnd, t)
        rnd += 1
    if ahead and not single:  # the rounds are done: the rollout workers are free for the next iteration
        ahead()
    replayed = t["replay"](spec, iteration, table)
    ckpt = t["update"](spec, iteration, replayed, policy)
    return t["publish"](spec, iteration, ckpt)


def _prefetch_next(spec: RunSpec, iteration: int, schedule: PolicySchedule) -> None:
    """Begin iteration + 1's rollout (its policy is known N ≥ 1 iterations ahead)."""
    if iteration + 1 < spec.cfg.run.iterations:
        online_stages(spec).prefetch_rollout(iteration + 1, PolicyRef(**schedule.sampling(iteration + 1)))


def _sampling_round(spec: RunSpec, iteration: int, policy: dict, rnd: int, t: dict, after_decode=None) -> dict:
    if rnd:
        t = {k: f.with_options(task_run_name=f"{k}[it={iteration},round={rnd}]") for k, f in t.items()}
    table = t["generate"](spec, iteration, policy, rnd)
    table = t["decode"](spec, iteration, table, rnd)
    if after_decode is not None:
        after_decode()
    return t["score"](spec, iteration, table, rnd)


@task(name="seed-fork", persist_result=False)
def seed_fork(spec: RunSpec, fork: dict) -> None:
    """Copy the parent's outputs of the stages before the fork point into this run's table."""
    seed_fork_rows(TrajectoryStore(fork["parent_table_uri"]), fork["parent_run_id"], fork["parent_table_version"],
                   fork["iteration"], fork["from_stage"], TrajectoryStore(spec.table_uri), spec.run_id)


def log_budget_reached(tracker, run_id: str, iteration: int, minutes: float) -> None:
    """The run stops early: said on the terminal and recorded on the MLflow run."""
    from prefect import get_run_logger

    get_run_logger().info("time budget of %g minutes reached after %d iterations; the run ends here", minutes, iteration)
    tracker.client.set_tag(run_id, "pixrl.stopped_by_budget", str(iteration))


@flow(name="pixrl-train")
def train(config: dict, workdir: str = "work", resume_run_id: str | None = None, fork: dict | None = None) -> dict:
    """Run `run.iterations` RL iterations from the base weights; returns where the results are.

    Every stage first asks the stores whether its output for (run, iteration) is committed and
    skips if so; resuming a run (or Prefect retrying this flow run) therefore redoes only the
    failed stage and what follows, with the same MLflow run. A fork (`pixrl replay --into`)
    starts at fork.iteration from the parent's policy, reusing the parent's earlier stages.
    One process at a time writes a run (artifacts/run_lock.py); an interrupt (SIGINT/SIGTERM)
    ends the MLflow run KILLED, any other failure FAILED."""
    cfg = ExperimentConfig.model_validate(config)
    preflight(cfg)
    with RunLock(workdir, cfg.run.name):  # before anything of the run is written
        try:
            return _train(cfg, workdir, resume_run_id, fork)
        finally:
            release_workers()


def _train(cfg: ExperimentConfig, workdir: str, resume_run_id: str | None, fork: dict | None) -> dict:
    spec = open_run(cfg.model_dump(mode="json"), workdir, resume_run_id, fork)
    stores = RunStores(spec)
    tracker = stores.tracker
    policy = PolicyRef(spec.model_name, 0).to_dict()
    start = 0
    if fork:
        seed_fork(spec, fork)
        policy, start = fork["policy"], fork["iteration"]
    schedule = PolicySchedule(cfg.run.staleness, start, policy, (fork or {}).get("earlier_policies"))
    every = cfg.run.eval_every if evaluates(cfg.dataset) else 0
    progress_id = start_progress(spec)
    yield_to_compute()  # the run's API-heavy opening is over; the server's background work now yields
    budget = cfg.run.time_budget_minutes
    began = time.monotonic()
    frozen = False
    try:
        if every and start == 0:
            evaluate.with_options(task_run_name="evaluate[after=0]")(spec, 0, policy)
        for it in range(start, cfg.run.iterations):
            if budget is not None and it > start and time.monotonic() - began >= 60 * budget:
                log_budget_reached(tracker, spec.run_id, it, budget)
                if every and it % every:  # the last iteration's policy is evaluated, as at the end of a run
                    evaluate.with_options(task_run_name=f"evaluate[after={it}]")(spec, it, policy)
                break
            progress.clear(spec.run_id, it)
            done = stores.published(it)
            if done is not None:  # resume: the iteration is published, so every stage of it is committed
                tracker.move_alias(done)  # a crash may have come between registration and the alias move
                tracker.log_missing_metrics(spec.run_id, {"policy_version": done.version}, step=it)
                for stage in STAGES:
                    progress.skipped(it, stage)
                policy = done.to_dict()
                schedule.published(it, policy)
                update_progress(progress_id, it + 1, cfg.run.iterations)
            else:
                t0 = time.perf_counter()
                policy = rl_iteration(spec, it, policy, schedule)
                schedule.published(it, policy)
                report_iteration.with_options(task_run_name=f"report[it={it}]")(spec, it, progress_id,
                                                                                cfg.run.iterations)
                wall = time.perf_counter() - t0  # the whole iteration, Prefect and reporting included
                if not frozen:  # once the model, stores and caches are loaded: the cyclic GC
                    gc.freeze()  # stops re-scanning them on every full collection
                    frozen = True  # (not gc.get_freeze_count(): it walks every frozen object,
                    # 0.05–0.14 s per call at 500k objects — measured with py-spy, 2026-12-03)
                stage_s = progress.stage_seconds(spec.run_id, it)
                if stage_s:  # an iteration found complete in the stores logs nothing again
                    tracker.log_metrics(spec.run_id, {"time/iteration_s": wall,
                                                      "orchestration_overhead": 1.0 - sum(stage_s.values()) / wall},
                                        step=it)
            if every and ((it + 1) % every == 0 or it + 1 == cfg.run.iterations):
                evaluate.with_options(task_run_name=f"evaluate[after={it + 1}]")(spec, it + 1, policy)
    except BaseException as exc:
        tracker.end_run(spec.run_id, end_status(exc))
        raise
    tracker.end_run(spec.run_id)
    return {"run_id": spec.run_id, "tracking_uri": spec.tracking_uri, "table_uri": spec.table_uri,
            "model_name": spec.model_name, "policy": policy, "workdir": spec.workdir,
            "flow_run_id": str(flow_run.get_id() or "")}
