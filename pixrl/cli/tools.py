"""Commands around the runs: pretrain the miniature, evaluate, generate, prompt sets, status,
the Prefect deployments, run comparison."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from .app import _fail, _workdir_tracker, _write_complete, app, console


@app.command()
def pretrain(
    out: Optional[str] = typer.Option(None, help="output directory (default: pixrl/assets/mini_shapes for sd3, "
                                                 "pixrl/assets/mini_janus for janus_pro)"),
    family: str = typer.Option("sd3", "--family", help="sd3 (the flow-matching miniature) or janus_pro (the token "
                                                       "miniature)"),
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
    vq_steps: int = typer.Option(1500, help="janus_pro: VQ-VAE steps"),
    ar_steps: int = typer.Option(6000, help="janus_pro: autoregressive decoder steps"),
    dataset_size: int = typer.Option(24000, help="janus_pro: renders tokenized once for the decoder phase"),
    log: Optional[str] = typer.Option(None, help="JSONL log file (default <out>.log.jsonl)"),
) -> None:
    """Pretrain a shapes-world miniature on CPU: the flow-matching one (VAE, text encoders,
    transformer; --family sd3) or the token one (VQ-VAE, then the Janus decoder; --family janus_pro)."""
    if family not in ("sd3", "janus_pro"):
        _fail(f"--family {family!r}: the miniatures are sd3 (flow matching) and janus_pro (token-autoregressive)")
    out = out or ("pixrl/assets/mini_shapes" if family == "sd3" else "pixrl/assets/mini_janus")
    log_path = Path(log or f"{out}.log.jsonl")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as fh:
        def emit(rec: dict) -> None:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            console.print(rec)

        if family == "janus_pro":
            from ..models.mini.token_pretrain import TokenPretrainConfig, pretrain_tokens

            pretrain_tokens(Path(out), TokenPretrainConfig(seed=seed, vq_steps=vq_steps, ar_steps=ar_steps,
                                                           dataset_size=dataset_size, threads=threads), log=emit)
            return
        from ..models.mini.build import MiniSpec
        from ..models.mini.pretrain import PretrainConfig, pretrain as run_pretrain

        cfg = PretrainConfig(seed=seed, vae_steps=vae_steps, denoiser_steps=denoiser_steps, threads=threads,
                             text_steps=text_steps, relation_twins=relation_twins)
        sizes = {"num_layers": layers, "text_hidden": text_hidden, "text_layers": text_layers}
        spec = MiniSpec(**{k: v for k, v in sizes.items() if v is not None})
        run_pretrain(Path(out), cfg, spec=spec, log=emit)


@app.command()
def tiny(
    family: str = typer.Argument(..., help="model family (see `pixrl tiny --help`): sd3, flux1, …"),
    out: str = typer.Option(..., "--out", help="new directory for the checkpoint (must not exist)"),
    seed: int = typer.Option(0),
    two_experts: bool = typer.Option(False, "--two-experts", help="wan, wan_i2v: Wan2.2-A14B's layout (a high- "
                                                                   "and a low-noise transformer)"),
) -> None:
    """Write a tiny random checkpoint of FAMILY in its real on-disk layout (real classes, small
    configs, tokenizers built offline) — to try a family without its weights, and for tests."""
    import inspect

    from ..models.registry import UnknownFamilyError, get_family

    try:
        fam = get_family(family)
    except UnknownFamilyError as exc:
        _fail(str(exc), exc=exc)
    if not hasattr(fam, "write_tiny"):
        _fail(f"family {family!r} has no tiny checkpoint writer")
    if two_experts and "two_experts" not in inspect.signature(fam.write_tiny).parameters:
        _fail(f"--two-experts: the {family} family has no two-expert layout (wan and wan_i2v have: Wan2.2-A14B)")
    dest, overrides = _write_complete(
        out, lambda staging: fam.write_tiny(staging, seed=seed, **({"two_experts": True} if two_experts else {})))
    console.print(f"[bold green]wrote[/] a tiny random {family} checkpoint to {dest}")
    console.print("  try it: pixrl train --iterations 2 " + " ".join(f"{k}={v}" for k, v in overrides.items()))
    print(json.dumps(overrides))


WEIGHTS_HELP = ("a pixrl checkpoint's 'average' (algorithm.ema) or 'trained' weights; default: its average "
                "where it has one, as the run evaluated it")


def _policy(checkpoint: Optional[str], run: Optional[str], workdir: str, steps: Optional[int],
            config: Optional[str] = None, weights: Optional[str] = None, negative_prompt: Optional[str] = None,
            model: Optional[dict] = None):
    from ..algorithms.recipe import eval_recipe
    from ..config.loader import ConfigError
    from ..stages.inference import PolicyNotFound, load_policy
    from ..models.sd3 import ModelLoadError

    try:
        policy, cfg = load_policy(checkpoint, run, workdir, config, weights, model)
    except (PolicyNotFound, ModelLoadError, ConfigError, FileNotFoundError) as exc:
        _fail(str(exc), exc=exc)
    s = cfg.sampling.model_copy(update={"eval_steps": steps} if steps else {})
    if negative_prompt is not None:
        from ..models.base import uses_negative_prompt

        if not uses_negative_prompt(policy.family, s.guidance_scale):
            _fail(f"--negative-prompt: this {policy.family.name} model samples with {policy.family.guidance} guidance "
                  f"at scale {s.guidance_scale}, which batches no negative prompt; drop --negative-prompt")
        s = s.model_copy(update={"negative_prompt": negative_prompt})
    return policy, eval_recipe(s, policy.family.semantics.step.value), cfg


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
    config: Optional[str] = typer.Option(None, "--config", "-c", help="experiment preset or YAML whose model (without "
                                                                      "--checkpoint/--run) and sampling are evaluated"),
    weights: Optional[str] = typer.Option(None, "--weights", help=WEIGHTS_HELP),
) -> None:
    """Judge accuracy of a policy on the shapes world, overall and per category; a run on a prompt
    set without an evaluator of its own is judged by its rewards (mean reward per category)."""
    if split not in ("heldout", "train"):
        _fail(f"--split must be 'heldout' or 'train', got {split!r}")
    from rich.table import Table

    from ..datasets.prompts import PromptSetError, split_items
    from ..datasets.registry import has_evaluator
    from ..datasets.reward_eval import reward_evaluation
    from ..datasets.shapes.evaluate import evaluate
    from ..rewards.compose import RewardSet

    policy, recipe, cfg = _policy(checkpoint, run, workdir, steps, config, weights)
    try:
        items = split_items(cfg.dataset, split)
    except (PromptSetError, FileNotFoundError) as exc:
        _fail(str(exc), exc=exc)
    if has_evaluator(cfg.dataset.name):
        res, what = evaluate(policy.family, items, recipe, per_category), ("shapes eval", "accuracy")
    else:  # a prompt set without its own evaluator: the run's rewards on it (datasets/reward_eval.py)
        sampling = cfg.sampling.model_copy(update={"eval_steps": steps} if steps else {})
        rewards = RewardSet.from_config(cfg.reward, device=cfg.model.device)
        res, what = reward_evaluation(policy.family, items, sampling, per_category, rewards), ("reward eval", "reward")
    how = (f"{recipe.steps} ODE steps" if hasattr(recipe, "steps") else
           f"token sampling, temperature {recipe.temperature}, top-k {recipe.top_k or 'off'}")
    table = Table(title=f"{what[0]} · {split} · {res['n']} samples · {how}, cfg {recipe.guidance_scale}")
    table.add_column("category")
    table.add_column(what[1], justify="right")
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
    from ..datasets.shapes.prompts import write_prompt_files

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
    weights: Optional[str] = typer.Option(None, "--weights", help=WEIGHTS_HELP),
    image: Optional[list[str]] = typer.Option(None, "--image", help="an editing family's source image: one for "
                                                                     "every prompt, or one per prompt (repeatable)"),
    negative_prompt: Optional[str] = typer.Option(None, "--negative-prompt", help="classifier-free guidance's "
                                                  "negative prompt (default: the run's sampling.negative_prompt)"),
    height: Optional[int] = typer.Option(None, "--height", help="image height in pixels (default: the model's size)"),
    width: Optional[int] = typer.Option(None, "--width", help="image width in pixels (default: the model's size)"),
) -> None:
    """Write one PNG per prompt and sample — an animated PNG per clip for a video family, with
    its soundtrack as a WAV beside it where the family makes sound (ltx2) — with the prompt in a
    sidecar JSON, using the eval sampler. An editing family (flux1_kontext) edits
    the --image given with each prompt. Images are also listed in `prompts.jsonl` (prompt, image):
    the folder is then a prompt set of source images (`dataset=edits dataset.path=OUT/prompts.jsonl`)
    — first frames for an image-to-video family, as DanceGRPO animates FLUX.1's images."""
    texts = list(prompt or [])
    if prompts:
        p = Path(prompts)
        if not p.is_file():
            _fail(f"--prompts file {prompts!r} does not exist")
        texts += [ln.strip() for ln in p.read_text().splitlines() if ln.strip()]
    if not texts:
        _fail("no prompts: pass --prompt TEXT (repeatable) or --prompts FILE")
    from ..artifacts.media import media_bytes, wav_bytes
    from ..datasets.shapes.evaluate import generate_images

    size = {k: v for k, v in (("height", height), ("width", width)) if v is not None}
    policy, recipe, _ = _policy(checkpoint, run, workdir, steps, weights=weights, negative_prompt=negative_prompt,
                                model=size)
    sources = _source_images(policy.family, image, len(texts))
    pairs = [(t, seed * 1000 + i * samples + k) for i, t in enumerate(texts) for k in range(samples)]
    sounds: list = []
    imgs = generate_images(policy.family, [t for t, _ in pairs], [s for _, s in pairs], recipe,
                           images=None if sources is None else [sources[n // samples] for n in range(len(pairs))],
                           soundtracks=sounds)
    od = Path(out)
    od.mkdir(parents=True, exist_ok=True)
    listed = []
    for n, ((text, s), img) in enumerate(zip(pairs, imgs)):
        stem = od / f"{n // samples:04d}_{n % samples:02d}"
        stem.with_suffix(".png").write_bytes(media_bytes(img))
        if sounds:
            stem.with_suffix(".wav").write_bytes(wav_bytes(*sounds[n]))
        stem.with_suffix(".json").write_text(json.dumps({"prompt": text, "seed": s, **recipe.to_dict()}))
        listed.append(json.dumps({"prompt": text, "image": stem.with_suffix(".png").name, "seed": s}))
    if imgs.ndim == 4:  # images, not clips: the folder as a prompt set of source images
        tmp = od / "prompts.jsonl.tmp"
        tmp.write_text("\n".join(listed) + "\n")
        tmp.replace(od / "prompts.jsonl")
    what = "clips with their soundtracks" if sounds else "clips" if imgs.ndim == 5 else "images"
    console.print(f"wrote {len(pairs)} {what} to {od}")


def _source_images(family, paths: Optional[list[str]], n: int) -> Optional[list[bytes]]:
    """Each prompt's source image for an editing family (one path for all, or one per prompt)."""
    takes = getattr(family, "takes_images", False)
    if not paths:
        if getattr(family, "needs_images", False):
            _fail(f"the {family.name} family {family.image_use}: pass --image PATH (one for every prompt, or one per "
                  "prompt)")
        return None
    if not takes:
        _fail(f"--image: the {family.name} family generates from text alone; drop --image")
    if len(paths) not in (1, n):
        _fail(f"{len(paths)} --image paths for {n} prompts: give one for every prompt, or one per prompt")
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        _fail(f"--image {missing[0]!r} does not exist")
    data = [Path(p).read_bytes() for p in paths]
    return data * n if len(data) == 1 else data


@app.command()
def status(
    run: str = typer.Argument(..., help="run name"),
    workdir: str = typer.Option("work", "--workdir"),
) -> None:
    """Per iteration, which stages are complete (read from the stores) and their references."""
    from rich.table import Table

    from ..stages.status import run_status
    from ..config.schema import STAGES

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
    from ..flows.deployments import (DPOParameters, EvalParameters, TrainParameters, evaluation,
                                    offline_dpo_training, online_training)

    dpo_defaults = DPOParameters.model_construct(sources=["default"], workdir=workdir).model_dump()
    eval_defaults = EvalParameters.model_construct(run_name="default", workdir=workdir).model_dump()
    from prefect.settings import PREFECT_API_URL

    from ..flows.api_server import start_local_api
    from ..flows.serving import serve as serve_deployments

    api_url = start_local_api() or PREFECT_API_URL.value()  # a temporary server, niced and watched, if none is set
    serve_deployments(
        online_training.to_deployment(name="online", parameters={"params": TrainParameters(workdir=workdir).model_dump()},
                                      tags=["pixrl", "online"], description="Online RL on the configured preset"),
        offline_dpo_training.to_deployment(name="dpo", parameters={"params": dpo_defaults}, tags=["pixrl", "offline"],
                                           description="Diffusion-DPO from archived rollouts"),
        evaluation.to_deployment(name="evaluate", parameters={"params": eval_defaults}, tags=["pixrl", "eval"],
                                 description="Held-out evaluation of a published policy"),
        api_url=api_url,
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

    from ..artifacts.comparison import list_runs

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


@app.command("export-model")
def export_model(
    out: str = typer.Option(..., "--out", help="directory to create (refused if it exists)"),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="a pixrl checkpoint directory"),
    run: Optional[str] = typer.Option(None, "--run", help="a run's version from --workdir's registry"),
    best: bool = typer.Option(False, "--best", help="with --run: its champion (best held-out) version, not its newest"),
    merge: bool = typer.Option(False, "--merge", help="fold a LoRA policy into whole weights (a full model "
                                                       "directory) instead of writing the adapter"),
    link: bool = typer.Option(False, "--link", help="hard-link the base model's untouched files instead of copying "
                                                     "them (same filesystem; they are never written)"),
    device: str = typer.Option("cpu", "--device", help="where the version is loaded (and merged)"),
    workdir: str = typer.Option("work", "--workdir"),
    weights: Optional[str] = typer.Option(None, "--weights", help=WEIGHTS_HELP),
) -> None:
    """Write a trained version in its base model's own format: a diffusers LoRA file
    (`pipe.load_lora_weights`), a whole diffusers pipeline directory (full fine-tune or --merge),
    or for Janus-Pro a PEFT adapter / transformers checkpoint; pixrl_export.json says how to load it."""
    from ..artifacts.model_export import export_policy
    from ..artifacts.tracking import CHAMPION_ALIAS, ROLLOUT_ALIAS
    from ..errors import ExpectedError
    from ..stages.inference import load_version_to_export

    if best and not run:
        _fail("--best picks a run's champion version: pass --run NAME with it")
    if Path(out).exists():
        _fail(f"{out} already exists; refusing to overwrite it — choose a new --out")
    try:
        policy, cfg, source = load_version_to_export(checkpoint, run, CHAMPION_ALIAS if best else ROLLOUT_ALIAS,
                                                     workdir, device, weights)
        manifest = export_policy(policy, cfg, Path(out), merge=merge, link=link, source=source)
    except (ExpectedError, FileNotFoundError) as exc:  # a bad path, run, config or base model: named
        _fail(str(exc), exc=exc)
    console.print(f"exported {cfg.model.family} ({manifest['format']}) to {out}\n  load: {manifest['load']}")
    print(json.dumps({"out": str(out), **manifest}))
