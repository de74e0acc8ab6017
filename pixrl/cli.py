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
    export: Optional[str] = typer.Option(None, "--export", help="write ref.json, metrics.json, reward_curve.csv here"),
) -> None:
    """Run online RL; with no --config, the default recipe (Flow-GRPO on the embedded miniature).

    Extra arguments are key=value overrides, e.g. `sampling.group_size=4 algorithm.lr=3e-4`.
    """
    cfg = _checked_config(config, list(ctx.args), iterations, workdir, run, seed)
    _run_training(cfg, cfg.run.workdir, None, export=export)


def _checked_config(config: Optional[str], overrides: list[str], iterations: Optional[int], workdir: Optional[str],
                    run: Optional[str], seed: Optional[int]):
    """The experiment config from a preset/YAML, key=value overrides and the common options,
    validated and preflighted (paths, assets, rewards) before anything is written."""
    from .config.loader import ConfigError, load_config
    from .engines.preflight import PreflightError, preflight

    for key, val in (("run.iterations", iterations), ("run.workdir", workdir), ("run.name", run), ("run.seed", seed)):
        if val is not None:
            overrides.append(f"{key}={val}")
    try:
        cfg = load_config(config, overrides)
        preflight(cfg)
    except (ConfigError, PreflightError) as exc:
        _fail(str(exc))
    return cfg


def _export(out: dict, export: Optional[str]) -> None:
    if export:
        from .artifacts.export import export_run
        from .artifacts.tracking import Tracker

        export_run(Tracker(out["tracking_uri"]), out["run_id"], Path(export))
        console.print(f"  exported     {export}/ref.json, metrics.json")


def _run_training(cfg, workdir: str, resume_run_id: Optional[str], fork: Optional[dict] = None,
                  export: Optional[str] = None) -> None:
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
            out = train_flow(cfg.model_dump(mode="json"), workdir, resume_run_id, fork)
        except Exception as exc:  # the flow already marked the MLflow run FAILED
            view.stop()
            _fail(f"{type(exc).__name__}: {exc}", code=1)
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
    from .flows.rollouts import RolloutsError, rollouts as rollouts_flow

    cfg = _checked_config(config, list(ctx.args), iterations, workdir, run, seed)
    if cfg.run.threads:
        import torch

        torch.set_num_threads(cfg.run.threads)
    s = cfg.sampling
    console.print(f"[bold]pixrl rollouts[/] {cfg.run.name}: policy version {policy_version} · {cfg.run.iterations} × "
                  f"{s.prompts_per_iteration} prompts × {s.group_size} samples · workdir {cfg.run.workdir}")
    from .progress_view import StageProgress

    with StageProgress(console, cfg.run.iterations, last_stage="score") as view:
        try:
            out = rollouts_flow(cfg.model_dump(mode="json"), cfg.run.workdir, policy_version)
        except RolloutsError as exc:
            view.stop()
            _fail(str(exc))
        except Exception as exc:  # the flow already marked the MLflow run FAILED
            view.stop()
            _fail(f"{type(exc).__name__}: {exc}", code=1)
    console.print(f"[bold green]done.[/] MLflow run {out['run_id']}  Lance table {out['table_uri']}")
    console.print(f"  next: pixrl dpo --from {cfg.run.name} --workdir {cfg.run.workdir}")
    print(json.dumps({k: out[k] for k in ("run_id", "table_uri", "model_name", "policy", "flow_run_id")}))


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
    from .config.loader import ConfigError, load_config
    from .config.schema import ExperimentConfig
    from .engines.lineage import FORKABLE, LineageError, replay_update
    from .flows.online import recorded_model_name, run_spec

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
            _fail(str(exc))
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
        _fail(str(exc))
    if not 0 <= iteration < cfg.run.iterations:
        _fail(f"--iteration {iteration} is outside the new run's 0..{cfg.run.iterations - 1}; raise --iterations")
    fork = _fork_point(tracker, parent, iteration, from_stage)
    _run_training(cfg, workdir, None, fork)


def _fork_point(tracker, parent, iteration: int, from_stage: str) -> dict:
    """Lineage of a fork: the parent, the pinned Lance version, and the policy that iteration's
    rollouts came from (the parent's version published by iteration−1, or its own fork policy)."""
    from .artifacts.tracking import PolicyRef
    from .artifacts.trajectories import TrajectoryStore
    from .engines.lineage import LineageError, fork_rows

    tags = tracker.client.get_run(parent.run_id).data.tags
    pfork = json.loads(tags["pixrl.fork"]) if "pixrl.fork" in tags else None
    start = pfork["iteration"] if pfork else 0
    if iteration < start:
        _fail(f"run {parent.run_name!r} starts at iteration {start} (it is a fork); pick --iteration ≥ {start}")
    if pfork and iteration == start:
        policy = pfork["policy"]
    elif iteration == 0:
        policy = PolicyRef(parent.model_name, 0).to_dict()
    else:
        ref = tracker.find_version(parent.model_name, parent.run_id, iteration - 1)
        if ref is None:
            _fail(f"run {parent.run_name!r} never published iteration {iteration - 1}, so iteration {iteration} "
                  f"has no policy to start from")
        from .artifacts.tracking import PrunedCheckpoint

        try:
            tracker.check_loadable(ref)
        except PrunedCheckpoint as exc:
            _fail(f"cannot fork at iteration {iteration}: {exc}")
        policy = ref.to_dict()
    version = TrajectoryStore(parent.table_uri).latest_version()
    try:
        fork_rows(TrajectoryStore(parent.table_uri), parent.run_id, version, iteration, from_stage)
    except LineageError as exc:
        _fail(str(exc))
    return {"parent_run_id": parent.run_id, "parent_run_name": parent.run_name, "iteration": iteration,
            "from_stage": from_stage, "parent_table_uri": parent.table_uri, "parent_table_version": version,
            "policy": policy}


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def dpo(
    ctx: typer.Context,
    sources: list[str] = typer.Option(..., "--from", help="run name, experiment:NAME or TABLE.lance[@version] (repeatable)"),
    iterations: Optional[int] = typer.Option(None, "--iterations", "-n", help="DPO optimizer steps (dpo.steps)"),
    run: Optional[str] = typer.Option(None, "--run", help="name of the DPO run (run.name)"),
    workdir: str = typer.Option("work", "--workdir"),
    config: str = typer.Option("shapes_dpo", "--config", "-c", help="experiment preset or YAML"),
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
    the source versions read. Extra key=value arguments override the config (e.g. dpo.beta=50)."""
    from .config.loader import ConfigError, load_config
    from .config.schema import ExperimentConfig

    overrides = [*ctx.args, f"run.workdir={workdir}"]
    for key, val in (("dpo.steps", iterations), ("run.name", run), ("run.seed", seed), ("dpo.pairing", pairing),
                     ("dpo.margin", margin), ("dpo.pair_on", pair_on), ("dpo.balance", balance)):
        if val is not None:
            overrides.append(f"{key}={val}")
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
        cfg = ExperimentConfig.model_validate({**cfg.model_dump(mode="json"), "dpo": d})
    except (ConfigError, ValueError) as exc:
        _fail(str(exc))
    import logging

    from rich.logging import RichHandler

    from .artifacts.archive import ArchiveError
    from .engines.offline import OfflineError
    from .flows.offline_dpo import offline_dpo

    progress_log = logging.getLogger("pixrl")
    progress_log.setLevel(logging.INFO)
    progress_log.addHandler(RichHandler(console=console, show_path=False))

    console.print(f"[bold]pixrl dpo[/] {cfg.run.name}: {cfg.dpo.steps} steps · {cfg.dpo.pairing} pairs from "
                  f"{', '.join(sources)} · workdir {workdir}")
    try:
        out = offline_dpo(cfg.model_dump(mode="json"), workdir)
    except (ArchiveError, OfflineError) as exc:
        _fail(str(exc))
    except Exception as exc:  # the flow already marked the MLflow run FAILED
        _fail(f"{type(exc).__name__}: {exc}", code=1)
    console.print(f"[bold green]done.[/] held-out accuracy {out['heldout_before']:.3f} → {out['heldout_after']:.3f}")
    console.print(f"  MLflow run  {out['run_id']}   policy models:/{out['model_name']}/{out['policy']['version']}")
    console.print(f"  sources     {', '.join(out['sources'])}   pairs {out['pairs_uri']}")
    _export(out, export)
    print(json.dumps({k: out[k] for k in ("run_id", "model_name", "policy", "heldout_before", "heldout_after", "sources",
                                          "flow_run_id")}))


@app.command()
def pretrain(
    out: str = typer.Option("pixrl/assets/mini_shapes", help="output directory (diffusers layout)"),
    seed: int = typer.Option(0),
    vae_steps: int = typer.Option(600),
    denoiser_steps: int = typer.Option(2000),
    threads: int = typer.Option(1, help="torch threads (results are reproducible per seed and thread count)"),
    layers: Optional[int] = typer.Option(None, help="transformer blocks (default: MiniSpec's)"),
    text_hidden: Optional[int] = typer.Option(None, help="width of each text encoder (default: MiniSpec's)"),
    text_layers: Optional[int] = typer.Option(None, help="layers of each text encoder (default: MiniSpec's)"),
    text_steps: int = typer.Option(0, help="CLIP-pretrain the text encoders this many steps first, then freeze them"),
    relation_twins: float = typer.Option(0.0, help="fraction of each denoiser batch made of relation-flipped twin "
                                                   "pairs (same scene, shapes' places exchanged, flipped caption)"),
    log: Optional[str] = typer.Option(None, help="JSONL log file (default <out>.log.jsonl)"),
) -> None:
    """Pretrain the shapes-world miniature (VAE, text encoders, transformer) on CPU."""
    from .models.mini.build import MiniSpec
    from .models.mini.pretrain import PretrainConfig, pretrain as run_pretrain

    cfg = PretrainConfig(seed=seed, vae_steps=vae_steps, denoiser_steps=denoiser_steps, threads=threads,
                         text_steps=text_steps, relation_twins=relation_twins)
    sizes = {"num_layers": layers, "text_hidden": text_hidden, "text_layers": text_layers}
    spec = MiniSpec(**{k: v for k, v in sizes.items() if v is not None})
    log_path = Path(log or f"{out}.log.jsonl")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as fh:
        def emit(rec: dict) -> None:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            console.print(rec)

        run_pretrain(Path(out), cfg, spec=spec, log=emit)


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
    run: Optional[str] = typer.Option(None, "--run", help="evaluate RUN's newest published version from --workdir"),
    split: str = typer.Option("heldout", "--split", help="heldout | train"),
    per_category: int = typer.Option(48, "--per-category", help="samples per category"),
    steps: Optional[int] = typer.Option(None, "--steps", help="ODE steps (default sampling.eval_steps)"),
    as_json: bool = typer.Option(False, "--json", help="last stdout line is a JSON object"),
    workdir: str = typer.Option("work", "--workdir"),
    out: Optional[str] = typer.Option(None, "--out", help="also write the JSON result to this file"),
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
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=2) + "\n")


@app.command()
def prompts(
    out: str = typer.Option(..., "--out", help="directory for prompts_train.parquet and prompts_heldout.parquet"),
    seed: int = typer.Option(0, "--seed", help="split seed (0 = the shipped split)"),
) -> None:
    """Write the shapes-world prompt sets (GenEval's six categories) with a held-out split of
    compositions that never occur in train."""
    from .datasets.shapes.prompts import write_prompt_files

    for split, path in write_prompt_files(Path(out), seed).items():
        console.print(f"{split}: {path}")


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


@app.command()
def serve(
    workdir: str = typer.Option("work", "--workdir", help="default workdir in the UI forms"),
) -> None:
    """Serve the training, DPO and evaluation deployments from this process (no work pool needed):
    start `prefect server start` first, then trigger runs from the UI at http://127.0.0.1:4200."""
    from prefect import serve as prefect_serve

    from .flows.deployments import (DPOParameters, EvalParameters, TrainParameters, evaluation,
                                    offline_dpo_training, online_training)

    dpo_defaults = DPOParameters.model_construct(sources=["default"], workdir=workdir).model_dump()
    eval_defaults = EvalParameters.model_construct(run_name="default", workdir=workdir).model_dump()
    prefect_serve(
        online_training.to_deployment(name="online", parameters={"params": TrainParameters(workdir=workdir).model_dump()},
                                      tags=["pixrl", "online"], description="Online RL on the configured preset"),
        offline_dpo_training.to_deployment(name="dpo", parameters={"params": dpo_defaults}, tags=["pixrl", "offline"],
                                           description="Diffusion-DPO from archived rollouts"),
        evaluation.to_deployment(name="evaluate", parameters={"params": eval_defaults}, tags=["pixrl", "eval"],
                                 description="Held-out evaluation of a published policy"),
    )


@app.command()
def runs(
    workdir: str = typer.Option("work", "--workdir"),
    experiment: Optional[str] = typer.Option(None, "--experiment", help="only this MLflow experiment"),
    as_json: bool = typer.Option(False, "--json", help="last stdout line is a JSON list"),
) -> None:
    """Compare runs: final/best train reward, held-out accuracy, images/s, duration, status."""
    from dataclasses import asdict

    from rich.table import Table

    from .artifacts.comparison import list_runs

    rows = list_runs(_workdir_tracker(workdir), experiment)
    fmt = lambda v, spec=".3f": "—" if v is None else format(v, spec)  # noqa: E731
    table = Table(title=f"pixrl runs · {workdir}")
    for col in ("run", "algorithm", "status", "its", "reward final", "reward best", "held-out", "held-out best",
                "img/s", "duration", "commit"):
        table.add_column(col, justify="left" if col in ("run", "algorithm", "status", "commit") else "right")
    for r in rows:
        table.add_row(r.name, r.algorithm, r.status, fmt(r.iterations, "d"), fmt(r.final_reward), fmt(r.best_reward),
                      fmt(r.heldout), fmt(r.best_heldout), fmt(r.images_per_s, ".1f"),
                      "—" if r.duration_s is None else f"{r.duration_s / 60:.1f} min", r.git_commit)
    Console().print(table)
    if as_json:
        print(json.dumps([asdict(r) for r in rows]))


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
