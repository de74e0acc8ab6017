"""pixrl command line: train, pretrain, eval, generate."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .config.environment import apply_defaults

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="RL post-training for visual generative models (Prefect + Lance + MLflow).")
console = Console(stderr=True)

apply_defaults()


def _workdir_tracker(workdir: str):
    """The MLflow tracker of an existing work directory, or a clear error."""
    from .artifacts.tracking import Tracker, default_tracking_uri

    if not (Path(workdir) / "mlflow.db").is_file():
        _fail(f"no pixrl work directory at {workdir!r} (no mlflow.db); pass --workdir")
    return Tracker(default_tracking_uri(Path(workdir)))


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
    _run_training(cfg, cfg.run.workdir, None)


def _run_training(cfg, workdir: str, resume_run_id: Optional[str]) -> None:
    if cfg.run.threads:
        import torch

        torch.set_num_threads(cfg.run.threads)
    from .flows.online import train as train_flow
    from .progress_view import StageProgress

    verb = "resume" if resume_run_id else "train"
    console.print(f"[bold]pixrl {verb}[/] {cfg.run.name}: {cfg.model.family} · {cfg.algorithm.name} · "
                  f"reward {', '.join(cfg.reward.weights)} · {cfg.run.iterations} iterations · workdir {workdir}")
    with StageProgress(console, cfg.run.iterations) as view:
        try:
            out = train_flow(cfg.model_dump(mode="json"), workdir, resume_run_id)
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
def resume(
    run: str = typer.Argument(..., help="run name to continue"),
    workdir: str = typer.Option("work", "--workdir"),
) -> None:
    """Continue a failed or killed run: stages whose outputs are committed are skipped."""
    from .config.schema import ExperimentConfig
    from .engines.preflight import PreflightError, preflight

    tracker = _workdir_tracker(workdir)
    run_id = tracker.find_run("pixrl.run_name", run)
    if run_id is None:
        _fail(f"no run named {run!r} in {workdir}")
    cfg = ExperimentConfig.model_validate(tracker.read_config(run_id))
    try:
        preflight(cfg)
    except PreflightError as exc:
        _fail(str(exc))
    _run_training(cfg, str(Path(workdir)), run_id)


@app.command()
def pretrain(
    out: str = typer.Option("pixrl/assets/mini_shapes", help="output directory (diffusers layout)"),
    seed: int = typer.Option(0),
    vae_steps: int = typer.Option(600),
    denoiser_steps: int = typer.Option(2000),
    threads: int = typer.Option(1, help="torch threads (results are reproducible per seed and thread count)"),
    log: Optional[str] = typer.Option(None, help="JSONL log file (default <out>.log.jsonl)"),
) -> None:
    """Pretrain the shapes-world miniature (VAE, text encoders, transformer) on CPU."""
    from .models.mini.pretrain import PretrainConfig, pretrain as run_pretrain

    cfg = PretrainConfig(seed=seed, vae_steps=vae_steps, denoiser_steps=denoiser_steps, threads=threads)
    log_path = Path(log or f"{out}.log.jsonl")
    with log_path.open("a") as fh:
        def emit(rec: dict) -> None:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            console.print(rec)

        run_pretrain(Path(out), cfg, log=emit)


def _policy(checkpoint: Optional[str], run: Optional[str], workdir: str, steps: Optional[int]):
    from .algorithms.recipe import eval_recipe
    from .config.loader import ConfigError
    from .engines.inference import PolicyNotFound, load_policy
    from .models.sd3 import ModelLoadError

    try:
        policy, cfg = load_policy(checkpoint, run, workdir)
    except (PolicyNotFound, ModelLoadError, ConfigError, FileNotFoundError) as exc:
        _fail(str(exc))
    s = cfg.sampling.model_copy(update={"eval_steps": steps} if steps else {})
    return policy, eval_recipe(s)


@app.command("eval")
def eval_cmd(
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="diffusers dir or pixrl checkpoint dir"),
    run: Optional[str] = typer.Option(None, "--run", help="evaluate models:/pixrl-RUN@rollout from --workdir"),
    split: str = typer.Option("heldout", "--split", help="heldout | train"),
    per_category: int = typer.Option(48, "--per-category", help="samples per category"),
    steps: Optional[int] = typer.Option(None, "--steps", help="ODE steps (default sampling.eval_steps)"),
    as_json: bool = typer.Option(False, "--json", help="last stdout line is a JSON object"),
    workdir: str = typer.Option("work", "--workdir"),
) -> None:
    """Judge accuracy of a policy on the shapes world, overall and per category."""
    if split not in ("heldout", "train"):
        _fail(f"--split must be 'heldout' or 'train', got {split!r}")
    from rich.table import Table

    from .datasets.shapes.evaluate import evaluate

    policy, recipe = _policy(checkpoint, run, workdir, steps)
    res = evaluate(policy.family, split, recipe, per_category)
    table = Table(title=f"shapes eval · {split} · {res['n']} samples · {recipe.steps} ODE steps, cfg {recipe.guidance_scale}")
    table.add_column("category")
    table.add_column("accuracy", justify="right")
    for k, v in res.items():
        if isinstance(v, float):
            table.add_row(k, f"{v:.3f}")
    console.print(table)
    if as_json:
        print(json.dumps(res))


@app.command()
def generate(
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", help="prompt text (repeatable)"),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="file with one prompt per line"),
    out: str = typer.Option(..., "--out", help="output directory"),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint"),
    run: Optional[str] = typer.Option(None, "--run"),
    samples: int = typer.Option(1, "--samples", help="images per prompt"),
    seed: int = typer.Option(0, "--seed"),
    steps: Optional[int] = typer.Option(None, "--steps"),
    workdir: str = typer.Option("work", "--workdir"),
) -> None:
    """Write one PNG per prompt and sample (prompt in a sidecar JSON), with the eval sampler."""
    texts = list(prompt or [])
    if prompts:
        p = Path(prompts)
        if not p.is_file():
            _fail(f"--prompts file {prompts!r} does not exist")
        texts += [ln.strip() for ln in p.read_text().splitlines() if ln.strip()]
    if not texts:
        _fail("no prompts: pass --prompt TEXT (repeatable) or --prompts FILE")
    from PIL import Image

    from .datasets.shapes.evaluate import generate_images

    policy, recipe = _policy(checkpoint, run, workdir, steps)
    pairs = [(t, seed * 1000 + i * samples + k) for i, t in enumerate(texts) for k in range(samples)]
    imgs = generate_images(policy.family, [t for t, _ in pairs], [s for _, s in pairs], recipe)
    od = Path(out)
    od.mkdir(parents=True, exist_ok=True)
    for n, ((text, s), img) in enumerate(zip(pairs, imgs)):
        stem = od / f"{n // samples:04d}_{n % samples:02d}"
        Image.fromarray(img).save(stem.with_suffix(".png"))
        stem.with_suffix(".json").write_text(json.dumps({"prompt": text, "seed": s, "steps": recipe.steps,
                                                         "guidance_scale": recipe.guidance_scale}))
    console.print(f"wrote {len(pairs)} images to {od}")


@app.command()
def status(
    run: str = typer.Argument(..., help="run name"),
    workdir: str = typer.Option("work", "--workdir"),
) -> None:
    """Per iteration, which stages are complete (read from the stores) and their references."""
    from rich.table import Table

    from .artifacts.status import run_status
    from .flows.online import STAGES

    run_id, its = run_status(Path(workdir), run, _workdir_tracker(workdir).uri)
    if run_id is None:
        _fail(f"no run named {run!r} in {workdir}")
    table = Table(title=f"run {run} · MLflow {run_id}")
    table.add_column("iteration", justify="right")
    for s in STAGES:
        table.add_column(s)
    for st in its:
        table.add_row(str(st.iteration), *[("[green]" + v + "[/]") if (v := st.stages.get(s)) else "[red]—[/]"
                                           for s in STAGES])
    Console().print(table)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
