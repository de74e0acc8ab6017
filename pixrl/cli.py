"""pixrl command line: train, pretrain, eval, generate."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="RL post-training for visual generative models (Prefect + Lance + MLflow).")
console = Console(stderr=True)

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _fail(msg: str, code: int = 2) -> None:
    console.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", "-c", help="experiment preset name or YAML path"),
    iterations: Optional[int] = typer.Option(None, "--iterations", "-n", help="RL iterations (run.iterations)"),
    workdir: Optional[str] = typer.Option(None, "--workdir", help="where stores live (run.workdir)"),
    run: Optional[str] = typer.Option(None, "--run", help="run name (run.name)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="run seed (run.seed)"),
) -> None:
    """Run online RL; with no --config, the default recipe (Flow-GRPO on the embedded miniature).

    Extra arguments are key=value overrides, e.g. `sampling.group_size=4 algorithm.lr=3e-4`.
    """
    from .config.loader import ConfigError, load_config
    from .engines.preflight import PreflightError, preflight

    overrides = list(ctx.args)
    for key, val in (("run.iterations", iterations), ("run.workdir", workdir), ("run.name", run), ("run.seed", seed)):
        if val is not None:
            overrides.append(f"{key}={val}")
    try:
        cfg = load_config(config, overrides)
        preflight(cfg)
    except (ConfigError, PreflightError) as exc:
        _fail(str(exc))
    if cfg.run.threads:
        import torch

        torch.set_num_threads(cfg.run.threads)
    from .flows.online import train as train_flow
    from .progress_view import StageProgress

    console.print(f"[bold]pixrl train[/] {cfg.run.name}: {cfg.model.family} · {cfg.algorithm.name} · "
                  f"reward {', '.join(cfg.reward.weights)} · {cfg.run.iterations} iterations · workdir {cfg.run.workdir}")
    with StageProgress(console, cfg.run.iterations) as view:
        try:
            out = train_flow(cfg.model_dump(mode="json"), cfg.run.workdir)
        except Exception as exc:  # the flow already marked the MLflow run FAILED
            view.stop()
            _fail(f"{type(exc).__name__}: {exc}", code=1)
    wd = Path(out["workdir"])
    console.print("\n[bold green]done.[/] Results:")
    console.print(f"  MLflow run   {out['run_id']}  (UI: mlflow ui --backend-store-uri {out['tracking_uri']})")
    console.print(f"  Lance table  {out['table_uri']}")
    console.print(f"  policy       models:/{out['model_name']}@rollout (version {out['policy']['version']})")
    console.print(f"  Prefect      flow run {out['flow_run_id']}  (UI: prefect server start)")
    console.print(f"  checkpoints  {wd / 'checkpoints' / cfg.run.name}")
    print(json.dumps({k: out[k] for k in ("run_id", "table_uri", "model_name", "flow_run_id")}))


@app.command()
def pretrain(
    out: str = typer.Option("pixrl/assets/mini_shapes", help="output directory (diffusers layout)"),
    seed: int = typer.Option(0),
    vae_minutes: float = typer.Option(10.0),
    transformer_minutes: float = typer.Option(85.0),
    log: Optional[str] = typer.Option(None, help="JSONL log file (default <out>.log.jsonl)"),
) -> None:
    """Pretrain the shapes-world miniature (VAE, text encoders, transformer) on CPU."""
    from .models.mini.pretrain import PretrainConfig, pretrain as run_pretrain

    cfg = PretrainConfig(seed=seed, vae_minutes=vae_minutes, transformer_minutes=transformer_minutes)
    log_path = Path(log or f"{out}.log.jsonl")
    with log_path.open("a") as fh:
        def emit(rec: dict) -> None:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            console.print(rec)

        run_pretrain(Path(out), cfg, log=emit)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
