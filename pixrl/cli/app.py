"""The Typer app and what every command shares: the console, failing with a message, a work
directory's tracker, a checked config, running the training flow with its progress view."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from ..config.environment import apply_defaults

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="RL post-training for visual generative models (Prefect + Lance + MLflow).")
console = Console(stderr=True)

apply_defaults()


@app.callback()
def _options(verbose: bool = typer.Option(False, "--verbose", help="show the libraries' INFO logging "
                                           "(Prefect, MLflow, alembic, transformers, diffusers)"),
             debug: bool = typer.Option(False, "--debug", help="show the traceback of every error, "
                                        "expected ones too (implies --verbose)")) -> None:
    """RL post-training for visual generative models (Prefect + Lance + MLflow)."""
    from .logs import configure

    configure(verbose, debug)


def _workdir_tracker(workdir: str):
    """The MLflow tracker of an existing work directory, or a clear error."""
    from ..artifacts.tracking import Tracker, default_tracking_uri

    if not (Path(workdir) / "mlflow.db").is_file():
        _fail(f"no pixrl work directory at {workdir!r} (no mlflow.db); pass --workdir")
    return Tracker(default_tracking_uri(Path(workdir)))


def _write_complete(out: str, write) -> tuple[Path, dict]:
    """`write(staging_dir) -> {key: value}` into a staging folder, then renamed to `out`: the folder
    is complete or absent (an existing one is refused, nothing is overwritten). The staging folder
    lies inside a scratch folder beside `out`, so what a writer builds beside it (tokenizers, a
    pipeline's pieces) goes with the scratch. The returned values name `out`'s resolved path where
    they named the staging folder."""
    import shutil

    dest = Path(out)
    if dest.exists():
        _fail(f"{dest} already exists; pass a new --out directory (nothing is overwritten)")
    scratch = dest.parent / f".{dest.name}.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    staging = scratch / dest.name
    try:
        written = write(staging)
        staging.rename(dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    here = str(dest.resolve())
    return dest, {k: v.replace(str(staging.resolve()), here).replace(str(staging), here) if isinstance(v, str) else v
                  for k, v in written.items()}


def _fail(msg: str, code: int = 2, exc: BaseException | None = None) -> None:
    """One line naming the problem (and the fix); with `pixrl --debug`, `exc`'s traceback first."""
    from rich.markup import escape

    from .logs import OPTIONS

    if OPTIONS.debug and exc is not None:
        from rich.traceback import Traceback

        console.print(Traceback.from_exception(type(exc), exc, exc.__traceback__))
    console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)  # one line; user text is not markup
    raise typer.Exit(code)


def _checked_config(config: Optional[str], overrides: list[str], iterations: Optional[int], workdir: Optional[str],
                    run: Optional[str], seed: Optional[int]):
    """The experiment config from a preset/YAML, key=value overrides and the common options,
    validated and preflighted (paths, assets, rewards) before anything is written."""
    from ..config.loader import ConfigError, load_config

    for key, val in (("run.iterations", iterations), ("run.workdir", workdir), ("run.name", run), ("run.seed", seed)):
        if val is not None:
            overrides.append(f"{key}={val}")
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        _fail(str(exc), exc=exc)
    _begin_api()  # the API server starts while preflight (torch, the stores) and the flow's imports run
    from ..stages.preflight import PreflightError, preflight

    try:
        preflight(cfg)
    except PreflightError as exc:
        _fail(str(exc), exc=exc)
    return cfg


def _export(out: dict, export: Optional[str]) -> None:
    if export:
        from ..artifacts.export import export_run
        from ..artifacts.tracking import Tracker

        export_run(Tracker(out["tracking_uri"]), out["run_id"], Path(export))
        console.print(f"  exported     {export}/ref.json, metrics.json")


def _interrupt_on_sigterm() -> None:
    """SIGTERM stops a run as Ctrl-C does: the running stage is abandoned before its commit, the
    MLflow run ends KILLED, the Prefect flow run Crashed, the run's lock is released and the API
    server stopped at exit. A second SIGTERM kills at once."""
    import signal

    def _handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _handler)


@contextmanager
def _interruptible(run: str, workdir: str, resume: bool = True):
    """Turn an interrupt of a flow into one message (with the command that continues) and exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        hint = f" Continue with: pixrl resume {run} --workdir {workdir}" if resume else ""
        console.print(f"\n[bold yellow]interrupted.[/] Run {run!r} stopped; every committed stage is kept.{hint}")
        raise typer.Exit(130) from None


@contextmanager
def _run_lock(workdir: str, run: str):
    """Hold the run's lock (artifacts/run_lock.py) around a flow, taken before the flow starts so
    that a refusal is one line and no Prefect flow run; the flow takes it again (re-entrant), so
    runs started from a deployment are guarded the same way."""
    from ..artifacts.run_lock import RunLock, RunLocked

    lock = RunLock(workdir, run)
    try:
        lock.acquire()
    except RunLocked as exc:
        _fail(str(exc), code=1, exc=exc)
    try:
        yield
    finally:
        lock.release()


def _begin_api() -> None:
    from ..flows.api_server import begin_local_api

    try:
        begin_local_api()
    except ValueError as exc:
        _fail(str(exc), exc=exc)


def _prepare_process(cfg, workdir: str) -> None:
    """Before a flow runs: SIGTERM handling, the configured compute threads, the run's MLflow
    store opened, and the local Prefect API server started at a lower CPU priority
    (flows/api_server.py) unless one is configured. The store is opened (SQLAlchemy, alembic,
    the copy of a fresh store) while the server is still starting in its own process: the flow's
    first task needs it, and the wait for the server was idle time of this one (≈ 1.5 s)."""
    _interrupt_on_sigterm()
    if cfg.run.threads:
        import torch

        torch.set_num_threads(cfg.run.threads)
    from ..stages.runs import tracker_for

    tracker_for(cfg, Path(workdir))
    from ..flows.api_server import start_local_api
    from .logs import quiet_expected_failures

    try:
        start_local_api()
    except ValueError as exc:
        _fail(str(exc), exc=exc)
    quiet_expected_failures()


def _run_training(cfg, workdir: str, resume_run_id: Optional[str], fork: Optional[dict] = None,
                  export: Optional[str] = None) -> None:
    from ..flows.online import train as train_flow
    from ..progress_view import StageProgress

    with _run_lock(workdir, cfg.run.name):
        _prepare_process(cfg, workdir)
        verb = "resume" if resume_run_id else "train"
        console.print(f"[bold]pixrl {verb}[/] {cfg.run.name}: {cfg.model.family} · {cfg.algorithm.name} · "
                      f"reward {', '.join(cfg.reward.weights)} · {cfg.run.iterations} iterations · workdir {workdir}")
        with _interruptible(cfg.run.name, workdir), StageProgress(console, cfg.run.iterations) as view:
            try:
                out = train_flow(cfg.model_dump(mode="json"), workdir, resume_run_id, fork)
            except Exception as exc:  # the flow already marked the MLflow run FAILED
                view.stop()
                _fail(f"{type(exc).__name__}: {exc}", code=1, exc=exc)
    wd = Path(out["workdir"])
    console.print("\n[bold green]done.[/] Results:")
    console.print(f"  MLflow run   {out['run_id']}  (UI: mlflow ui --backend-store-uri {out['tracking_uri']})")
    console.print(f"  Lance table  {out['table_uri']}")
    console.print(f"  policy       models:/{out['model_name']}/{out['policy']['version']} (alias rollout = the "
                  f"experiment's latest; champion = its best held-out)")
    console.print(f"  Prefect      flow run {out['flow_run_id']}  (UI: prefect server start)")
    console.print(f"  checkpoints  {wd / 'checkpoints' / cfg.run.name}")
    _export(out, export)
    print(json.dumps({k: out[k] for k in ("run_id", "table_uri", "model_name", "flow_run_id")}))


def main() -> None:  # pragma: no cover
    app()
