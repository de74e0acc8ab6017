"""Commands that run or continue flows: train, rollouts, resume, replay (and forks), dpo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .app import (_begin_api, _checked_config, _export, _fail, _interruptible, _prepare_process, _run_lock,
                  _run_training, _workdir_tracker, app, console)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", "-c", help="experiment preset name or YAML path"),
    iterations: Optional[int] = typer.Option(None, "--iterations", "-n", help="RL iterations (run.iterations)"),
    workdir: Optional[str] = typer.Option(None, "--workdir", help="where stores live (run.workdir)"),
    run: Optional[str] = typer.Option(None, "--run", help="run name (run.name)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="run seed (run.seed)"),
    export: Optional[str] = typer.Option(None, "--export", help="write ref.json, metrics.json, reward_curve.csv here"),
) -> None:
    """Run online RL; with no --config, the default recipe (Flow-GRPO on the embedded miniature).

    Extra arguments are key=value overrides, e.g. `sampling.group_size=4 algorithm.lr=3e-4`.
    """
    cfg = _checked_config(config, list(ctx.args), iterations, workdir, run, seed)
    _run_training(cfg, cfg.run.workdir, None, export=export)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def rollouts(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", "-c", help="experiment preset name or YAML path"),
    iterations: Optional[int] = typer.Option(None, "--iterations", "-n", help="batches of groups (run.iterations)"),
    workdir: Optional[str] = typer.Option(None, "--workdir", help="where stores live (run.workdir)"),
    run: Optional[str] = typer.Option(None, "--run", help="run name (run.name)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="run seed (run.seed)"),
    policy_version: int = typer.Option(0, "--policy-version",
                                       help="version of the experiment's registered model; 0 = base weights"),
) -> None:
    """Archive scored rollouts of one policy without training (generate → decode → score), for
    offline training: `pixrl dpo --from RUN` mines them like an RL run's archive."""
    from ..flows.rollouts import RolloutsError, rollouts as rollouts_flow

    cfg = _checked_config(config, list(ctx.args), iterations, workdir, run, seed)
    with _run_lock(cfg.run.workdir, cfg.run.name):
        _prepare_process(cfg, cfg.run.workdir)
        s = cfg.sampling
        console.print(f"[bold]pixrl rollouts[/] {cfg.run.name}: policy version {policy_version} · {cfg.run.iterations} × "
                      f"{s.prompts_per_iteration} prompts × {s.group_size} samples · workdir {cfg.run.workdir}")
        from ..progress_view import StageProgress

        with _interruptible(cfg.run.name, cfg.run.workdir, resume=False), \
                StageProgress(console, cfg.run.iterations, last_stage="score") as view:
            try:
                out = rollouts_flow(cfg.model_dump(mode="json"), cfg.run.workdir, policy_version)
            except RolloutsError as exc:
                view.stop()
                _fail(str(exc), exc=exc)
            except Exception as exc:  # the flow already marked the MLflow run FAILED
                view.stop()
                _fail(f"{type(exc).__name__}: {exc}", code=1, exc=exc)
    console.print(f"[bold green]done.[/] MLflow run {out['run_id']}  Lance table {out['table_uri']}")
    console.print(f"  next: pixrl dpo --from {cfg.run.name} --workdir {cfg.run.workdir}")
    print(json.dumps({k: out[k] for k in ("run_id", "table_uri", "model_name", "policy", "flow_run_id")}))


@app.command()
def resume(
    run: str = typer.Argument(..., help="run name to continue"),
    workdir: str = typer.Option("work", "--workdir"),
) -> None:
    """Continue a failed or killed run: stages whose outputs are committed are skipped."""
    from ..config.schema import ExperimentConfig
    from ..stages.preflight import PreflightError, preflight

    if (Path(workdir) / "mlflow.db").is_file():
        _begin_api()  # while the run's config is read back and preflighted
    tracker = _workdir_tracker(workdir)
    run_id = tracker.find_run("pixrl.run_name", run)
    if run_id is None:
        _fail(f"no run named {run!r} in {workdir}")
    cfg = ExperimentConfig.model_validate(tracker.read_config(run_id))
    try:
        preflight(cfg)
    except PreflightError as exc:
        _fail(str(exc), exc=exc)
    fork = tracker.client.get_run(run_id).data.tags.get("pixrl.fork")  # a fork resumes from its fork point
    _run_training(cfg, str(Path(workdir)), run_id, json.loads(fork) if fork else None)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def replay(
    ctx: typer.Context,
    run: str = typer.Argument(..., help="run name"),
    iteration: int = typer.Option(..., "--iteration", help="the iteration to replay"),
    from_stage: Optional[str] = typer.Option(None, "--from-stage",
                                             help="fork: recompute from this stage on (generate … update)"),
    into: Optional[str] = typer.Option(None, "--into", help="fork: name of the new run"),
    iterations: Optional[int] = typer.Option(None, "--iterations", "-n", help="fork: run.iterations of the new run"),
    workdir: str = typer.Option("work", "--workdir"),
) -> None:
    """Re-run iteration N's update from its stored trajectories and report whether the weights
    equal the recorded checkpoint; with --from-stage and --into, fork a new run from there.

    A fork takes key=value overrides (e.g. `algorithm.lr=3e-5 reward=jpeg_compressibility`)."""
    from ..config.loader import ConfigError, load_config
    from ..config.schema import ExperimentConfig
    from ..stages.lineage import FORKABLE, LineageError, replay_update
    from ..run import run_spec
    from ..stages.runs import recorded_model_name

    tracker = _workdir_tracker(workdir)
    parent_id = tracker.find_run("pixrl.run_name", run)
    if parent_id is None:
        _fail(f"no run named {run!r} in {workdir}")
    parent_cfg = ExperimentConfig.model_validate(tracker.read_config(parent_id))
    parent = run_spec(parent_cfg, Path(workdir), parent_id, recorded_model_name(tracker, parent_id))
    if (from_stage is None) != (into is None):
        _fail("a fork needs both --from-stage STAGE and --into NEW_RUN")
    if into is None:
        if ctx.args or iterations is not None:
            _fail(f"overrides {ctx.args} and --iterations only apply to a fork (--from-stage/--into)")
        try:
            rep = replay_update(parent, iteration)
        except LineageError as exc:
            _fail(str(exc), exc=exc)
        verdict = "[green]equal[/]" if rep.equal else f"[red]differ[/] in {len(rep.differing)} tensors (max |Δ| {rep.max_abs_diff:.3g})"
        console.print(f"replayed update of {run} iteration {iteration}: {rep.tensors} tensors, {verdict} "
                      f"to the recorded checkpoint {rep.recorded}")
        print(json.dumps(rep.to_dict()))
        raise typer.Exit(0 if rep.equal else 1)
    if from_stage not in FORKABLE:
        _fail(f"--from-stage must be one of {', '.join(FORKABLE)}, got {from_stage!r}")
    if tracker.find_run("pixrl.run_name", into) is not None:
        _fail(f"a run named {into!r} already exists in {workdir}; pick a new name, or `pixrl resume {into}`")
    overrides = [*ctx.args, f"run.name={into}", f"run.workdir={workdir}"]
    if iterations is not None:
        overrides.append(f"run.iterations={iterations}")
    try:
        cfg = load_config(None, overrides, base=parent_cfg.model_dump(mode="json"))
    except ConfigError as exc:
        _fail(str(exc), exc=exc)
    if not 0 <= iteration < cfg.run.iterations:
        _fail(f"--iteration {iteration} is outside the new run's 0..{cfg.run.iterations - 1}; raise --iterations")
    fork = _fork_point(tracker, parent, iteration, from_stage, into, cfg.run.staleness)
    _run_training(cfg, workdir, None, fork)


def _fork_point(tracker, parent, iteration: int, from_stage: str, into: str, staleness: int = 0) -> dict:
    """Lineage of a fork: the parent, the pinned Lance version, the policy that iteration's update
    starts from (the parent's version published by iteration−1, or its own fork policy) and, for
    run.staleness = N, the policies the N iterations before it started from (their rollouts'
    sampling policies)."""
    from ..artifacts.tracking import PolicyRef
    from ..artifacts.trajectories import TrajectoryStore
    from ..stages.lineage import LineageError, fork_rows

    tags = tracker.client.get_run(parent.run_id).data.tags
    pfork = json.loads(tags["pixrl.fork"]) if "pixrl.fork" in tags else None
    start = pfork["iteration"] if pfork else 0
    if iteration < start:
        _fail(f"run {parent.run_name!r} starts at iteration {start} (it is a fork); pick --iteration ≥ {start}")
    policy = _updated_from(tracker, parent, pfork, iteration)
    if policy["version"] and not (pfork and iteration == start):
        from ..artifacts.tracking import PrunedCheckpoint

        try:
            tracker.check_trainable(PolicyRef(**policy), f"a fork at iteration {iteration}")
        except PrunedCheckpoint as exc:
            _fail(f"cannot fork at iteration {iteration}: {exc}")
    earlier = {j: _updated_from(tracker, parent, pfork, j) for j in range(max(0, iteration - staleness), iteration)}
    version = TrajectoryStore(parent.table_uri).latest_version()
    try:
        fork_rows(TrajectoryStore(parent.table_uri), parent.run_id, version, iteration, from_stage)
    except LineageError as exc:
        _fail(str(exc), exc=exc)
    if version is not None:  # the fork reads this version later: keep it through the parent's cleanups
        from ..artifacts.store_maintenance import pin_version

        pin_version(TrajectoryStore(parent.table_uri), version, f"fork-{into}")
    return {"parent_run_id": parent.run_id, "parent_run_name": parent.run_name, "iteration": iteration,
            "from_stage": from_stage, "parent_table_uri": parent.table_uri, "parent_table_version": version,
            "policy": policy, "earlier_policies": earlier}


def _updated_from(tracker, parent, pfork: dict | None, j: int) -> dict:
    """The policy the parent's iteration j started its update from: its version published by
    j − 1, the base weights at 0, or — for a parent that is itself a fork — what its fork
    carried (run.staleness samples with these N iterations back)."""
    from ..artifacts.tracking import PolicyRef

    start = pfork["iteration"] if pfork else 0
    if pfork and j == start:
        return pfork["policy"]
    if pfork and j < start:
        got = (pfork.get("earlier_policies") or {}).get(str(j))
        if got is None:
            _fail(f"run {parent.run_name!r} is a fork from iteration {start} and does not record the policy its "
                  f"parent's iteration {j} started from, which run.staleness samples with; fork at ≥ {start} + "
                  f"run.staleness, or from its parent")
        return got
    if j == 0:
        return PolicyRef(parent.model_name, 0).to_dict()
    ref = tracker.find_version(parent.model_name, parent.run_id, j - 1)
    if ref is None:
        _fail(f"run {parent.run_name!r} never published iteration {j - 1}, so iteration {j} has no policy to start "
              f"from")
    return ref.to_dict()


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def dpo(
    ctx: typer.Context,
    sources: list[str] = typer.Option(..., "--from", help="run name, experiment:NAME or TABLE.lance[@version] (repeatable)"),
    iterations: Optional[int] = typer.Option(None, "--iterations", "-n", help="DPO optimizer steps (dpo.steps)"),
    run: Optional[str] = typer.Option(None, "--run", help="name of the DPO run (run.name)"),
    workdir: str = typer.Option("work", "--workdir"),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="experiment preset or YAML (default: "
                                                                       "shapes_dpo; `pixrl sft`: shapes_sft)"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    iteration_range: Optional[str] = typer.Option(None, "--iteration-range", help="source iterations LO:HI (HI excluded)"),
    policy_version: Optional[list[int]] = typer.Option(None, "--policy-version", help="only rollouts of this version (repeatable)"),
    reward_min: Optional[list[str]] = typer.Option(None, "--reward-min", help="NAME=VALUE, NAME = reward or a component"),
    reward_max: Optional[list[str]] = typer.Option(None, "--reward-max", help="NAME=VALUE"),
    category: Optional[list[str]] = typer.Option(None, "--category", help="prompt category (repeatable)"),
    pairing: Optional[str] = typer.Option(None, "--pairing", help="best_worst | all"),
    margin: Optional[float] = typer.Option(None, "--margin", help="minimum reward difference of a pair"),
    pair_on: Optional[str] = typer.Option(None, "--pair-on", help="rank groups by 'reward' or a component (shapes.correct)"),
    balance: Optional[str] = typer.Option(None, "--balance", help="none | category (pairs per step drawn per category)"),
    export: Optional[str] = typer.Option(None, "--export", help="write ref.json, metrics.json, dpo_curve.csv here"),
) -> None:
    """Offline Diffusion-DPO on preference pairs mined from archived rollouts (Lance), pinned to
    the source versions read; `pixrl sft` (or --config shapes_sft): SFT on each pair's winner
    instead. Extra key=value arguments override the config (e.g. algorithm.beta=50)."""
    command = ctx.info_name or "dpo"
    overrides = [*ctx.args, f"run.workdir={workdir}"]
    for key, val in (("dpo.steps", iterations), ("run.name", run), ("run.seed", seed), ("dpo.pairing", pairing),
                     ("dpo.margin", margin), ("dpo.pair_on", pair_on), ("dpo.balance", balance)):
        if val is not None:
            overrides.append(f"{key}={val}")
    cfg = _dpo_config(config or f"shapes_{command}", overrides, sources, iteration_range, policy_version, reward_min,
                      reward_max, category)
    _check_sources(sources, workdir)
    _begin_api()
    from ..artifacts.archive import ArchiveError
    from ..stages.offline import OfflineError
    from ..flows.offline_dpo import offline_dpo

    _log_progress()
    with _run_lock(workdir, cfg.run.name):
        _prepare_process(cfg, workdir)
        console.print(f"[bold]pixrl {command}[/] {cfg.run.name} ({cfg.algorithm.name}): {cfg.dpo.steps} steps · "
                      f"{cfg.dpo.pairing} pairs from {', '.join(sources)} · workdir {workdir}")
        with _interruptible(cfg.run.name, workdir, resume=False):
            try:
                out = offline_dpo(cfg.model_dump(mode="json"), workdir)
            except (ArchiveError, OfflineError) as exc:
                _fail(str(exc), exc=exc)
            except Exception as exc:  # the flow already marked the MLflow run FAILED
                _fail(f"{type(exc).__name__}: {exc}", code=1, exc=exc)
    if out["heldout_before"] is None:
        console.print(f"[bold green]done.[/] not evaluated: {out['not_evaluated']}")
    else:
        console.print(f"[bold green]done.[/] held-out accuracy {out['heldout_before']:.3f} → {out['heldout_after']:.3f}")
    console.print(f"  MLflow run  {out['run_id']}   policy models:/{out['model_name']}/{out['policy']['version']}")
    console.print(f"  sources     {', '.join(out['sources'])}   pairs {out['pairs_uri']}")
    _export(out, export)
    print(json.dumps({k: out[k] for k in ("run_id", "model_name", "policy", "heldout_before", "heldout_after", "sources",
                                          "flow_run_id")}))


app.command("sft", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
            help="Offline SFT on the winner of each preference pair mined from archived rollouts, as `pixrl dpo` "
                 "mines them (experiment shapes_sft: diffusion_sft; algorithm=token_sft for a token family); the "
                 "same options.")(dpo)


def _log_progress() -> None:
    """The offline flow's progress lines (logger `pixrl`) on the terminal."""
    import logging

    from rich.logging import RichHandler

    progress_log = logging.getLogger("pixrl")
    progress_log.setLevel(logging.INFO)
    progress_log.addHandler(RichHandler(console=console, show_path=False))


def _check_sources(sources: list[str], workdir: str) -> None:
    """Refuse unknown sources in one line before anything starts (no API server, no run, no
    MLflow store created in a work directory that has none); the flow pins them again."""
    from ..artifacts.archive import ArchiveError, resolve_sources
    from ..artifacts.tracking import Tracker, default_tracking_uri

    by_name = [s for s in sources if ".lance" not in s]
    if by_name and not (Path(workdir) / "mlflow.db").is_file():
        _fail(f"no pixrl work directory at {workdir!r} (no mlflow.db) to look up {', '.join(map(repr, by_name))} in; "
              f"pass the --workdir of the source runs, or a PATH.lance source")
    try:
        resolve_sources(sources, Tracker(default_tracking_uri(Path(workdir))) if by_name else None)
    except ArchiveError as exc:
        _fail(str(exc), exc=exc)


def _dpo_config(config: str, overrides: list[str], sources: list[str], iteration_range: Optional[str],
                policy_version: Optional[list[int]], reward_min: Optional[list[str]], reward_max: Optional[list[str]],
                category: Optional[list[str]]):
    """The DPO experiment config with the source filters of the command line, validated."""
    from ..config.loader import ConfigError, load_config
    from ..config.schema import ExperimentConfig

    try:
        cfg = load_config(config, overrides)
        if cfg.dpo is None:
            raise ConfigError(f"config {config!r} has no dpo section; use --config shapes_dpo or add dpo=best_worst")
        d = cfg.dpo.model_dump()
        d["source"] = list(sources)
        if iteration_range:
            lo, _, hi = iteration_range.partition(":")
            d["iteration_range"] = (int(lo), int(hi))
        if policy_version:
            d["policy_versions"] = list(policy_version)
        for field, items in (("reward_min", reward_min), ("reward_max", reward_max)):
            for item in items or []:
                name, _, val = item.partition("=")
                d[field][name] = float(val)
        if category:
            d["categories"] = list(category)
        return ExperimentConfig.model_validate({**cfg.model_dump(mode="json"), "dpo": d})
    except (ConfigError, ValueError) as exc:
        _fail(str(exc), exc=exc)
