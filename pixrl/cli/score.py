"""`pixrl score`: score a folder of images (or clips) with any registered rewards before
training with them — one JSON line per file with every component, the prompt taken from
--prompt or from each file's sidecar JSON (as `pixrl generate` writes them), a clip's soundtrack
from the WAV beside it. `pixrl
reward-serve`: the same reward sets behind HTTP, for runs with reward=remote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .app import _fail, _write_complete, app, console

MEDIA = {".png", ".jpg", ".jpeg", ".webp", ".mp4"}


@app.command()
def score(
    reward: str = typer.Option(..., "--reward", help="reward name(s), comma-separated, e.g. clip_score,jpeg_compressibility"),
    images: str = typer.Option(..., "--images", help="folder of images (PNG/JPEG/WebP) or clips (MP4)"),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="the prompt of every file (else each file's sidecar JSON)"),
    options: Optional[list[str]] = typer.Argument(None, help="reward options, e.g. clip_score.path=/ckpt/clip"),
    device: str = typer.Option("cpu", "--device"),
    dataset: Optional[str] = typer.Option(None, "--dataset",
                                          help="parse prompt metadata with this dataset's parser (e.g. shapes)"),
) -> None:
    """Score every file in --images; nothing is written but the JSON lines on stdout. A group
    reward (pairwise_judge) compares the files that share a prompt with each other."""
    import numpy as np

    from ..rewards.base import ScoringError
    from ..rewards.compose import RewardSet

    folder = Path(images)
    if not folder.is_dir():
        _fail(f"--images {images!r} is not a folder")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in MEDIA)
    if not files:
        _fail(f"no images or clips ({', '.join(sorted(MEDIA))}) in {images!r}")
    names = [n.strip() for n in reward.split(",") if n.strip()]
    try:
        rewards = RewardSet({n: 1.0 for n in names}, _reward_options(options), device=device)
    except (KeyError, ValueError) as exc:
        _fail(exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc), exc=exc)
    parse = None
    if dataset:
        from ..datasets.registry import prompt_parser

        parse = prompt_parser(dataset)
        if parse is None:
            _fail(f"dataset {dataset!r} has no prompt-metadata parser")
    samples = [_sample(path, prompt, parse) for path in files]
    # a group reward compares the files with the same prompt: the folder is scored at once
    batches = [samples] if rewards.groupwise else [[s] for s in samples]
    for batch in batches:
        shapes = {s[3].shape for s in batch}
        if len(shapes) > 1:
            _fail(f"{', '.join(sorted(rewards.rewards))} compare(s) the images of a prompt, which must share one size; "
                  f"{images!r} holds {sorted(shapes)}")
        try:
            scores = rewards.score(np.stack([s[3] for s in batch]), [s[1] for s in batch], [s[2] for s in batch],
                                   [s[0] for s in batch])
        except ScoringError as exc:
            _fail(f"{batch[0][0] if len(batch) == 1 else images}: {exc}", exc=exc)
        for i, (name, text, _, _) in enumerate(batch):
            print(json.dumps({"file": name, "prompt": text,
                              **{k: float(np.asarray(v)[i]) for k, v in scores.items() if k != "reward"}}))


def _sample(path: Path, prompt: str | None, parse) -> tuple:
    """(file name, prompt, metadata, pixels) of one file: the metadata its sidecar JSON (or
    `parse`) gives, with a clip's playing rate and the soundtrack in the WAV beside it."""
    from ..artifacts.media import clip_rate, decode_media

    text, meta = _prompt_of(path, prompt)
    if parse is not None and not meta:
        meta = parse(text)
    data = path.read_bytes()
    sample = decode_media(data) if path.suffix.lower() in {".png", ".mp4"} else _read_image(path)
    if (rate := clip_rate(data)) is not None:
        meta = {**meta, "fps": rate}  # the rate it plays at: a video reward reads frames per second of it
    if (sound := path.with_suffix(".wav")).is_file():  # its soundtrack (`pixrl generate` writes it beside)
        meta = {**meta, "soundtrack": sound.read_bytes()}
    return path.name, text, meta, sample


def _prompt_of(path: Path, prompt: str | None) -> tuple[str, dict]:
    side = path.with_suffix(".json")
    meta = json.loads(side.read_text()) if side.is_file() else {}
    text = prompt if prompt is not None else meta.get("prompt")
    if text is None:
        _fail(f"{path.name}: no prompt — pass --prompt TEXT or put {side.name} with a \"prompt\" key beside it")
    return text, meta.get("prompt_meta", {})


def _read_image(path: Path):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))


def _value(text: str):
    """An option value as YAML reads it (numbers, booleans, lists), else the string."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _reward_options(options: list[str] | None) -> dict[str, dict]:
    opts: dict[str, dict] = {}
    for item in options or []:
        key, sep, value = item.partition("=")
        name, dot, opt = key.partition(".")
        if not sep or not dot:
            _fail(f"reward option {item!r}: expected REWARD.OPTION=VALUE, e.g. clip_score.path=/ckpt/clip")
        opts.setdefault(name, {})[opt] = _value(value)
    return opts


@app.command("reward-serve")
def reward_serve(
    reward: str = typer.Option(..., "--reward", help="reward name(s), comma-separated; NAME:WEIGHT sets a weight"),
    options: Optional[list[str]] = typer.Argument(None, help="reward options, e.g. clip_score.path=/ckpt/clip"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8765, "--port"),
    token: Optional[str] = typer.Option(None, "--token", envvar="PIXRL_REWARD_TOKEN",
                                        help="bearer token /score requires (default: $PIXRL_REWARD_TOKEN; none: open)"),
    max_mb: float = typer.Option(64.0, "--max-mb", help="largest request body accepted"),
    max_batch: int = typer.Option(256, "--max-batch", help="most images in one request"),
    queue_timeout: float = typer.Option(600.0, "--queue-timeout", help="seconds a request may wait behind others "
                                                                       "before it is answered 503 (retry later)"),
    device: str = typer.Option("cpu", "--device"),
    accept_pickle: bool = typer.Option(False, "--accept-pickle",
                                       help="also answer flow_grpo's clients (a pickled dict POSTed to /); "
                                            "only plain data and numpy arrays are unpickled"),
) -> None:
    """Serve a reward set over HTTP (GET /health, POST /score) for runs with reward=remote."""
    import uvicorn

    from ..rewards.compose import RewardSet
    from ..rewards.service import build_app

    weights = {}
    for item in reward.split(","):
        name, _, w = item.strip().partition(":")
        if name:
            weights[name] = float(w) if w else 1.0
    try:
        rewards = RewardSet(weights, _reward_options(options), device=device)
        rewards.check_installed()
    except (KeyError, ValueError) as exc:
        _fail(exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc), exc=exc)
    console.print(f"serving {', '.join(weights)} at http://{host}:{port} (POST /score, GET /health, GET /metrics)"
                  + ("" if token else " — no token: anyone who reaches the port can score"))
    if accept_pickle:
        console.print(f"also accepting flow_grpo's pickled requests at http://{host}:{port}/")
    uvicorn.run(build_app(rewards, token, int(max_mb * 2**20), max_batch, queue_timeout, accept_pickle), host=host, port=port,
                log_level="warning")


@app.command("tiny-reward")
def tiny_reward(
    reward: str = typer.Argument(..., help="clip_score, pickscore, aesthetic, imagereward, clap_score, hpsv3, editreward or videoalign"),
    out: str = typer.Option(..., "--out", help="new directory for the checkpoint (must not exist)"),
    seed: int = typer.Option(0),
) -> None:
    """Write a tiny random checkpoint of a model-based REWARD in its released layout — to try the
    reward (or srpo's and draft's gradient, a soundtrack reward) without its weights — and print its options."""
    from ..rewards.tiny import TINY_REWARDS, write_tiny_reward

    if reward not in TINY_REWARDS:
        _fail(f"reward {reward!r} has no tiny checkpoint writer; these have: {', '.join(sorted(TINY_REWARDS))} "
              f"(rule-based rewards need none)")
    dest, options = _write_complete(out, lambda staging: write_tiny_reward(reward, staging, seed))
    overrides = {f"reward.weights.{reward}": 1.0, **{f"reward.options.{reward}.{k}": v for k, v in options.items()}}
    console.print(f"[bold green]wrote[/] a tiny random {reward} checkpoint to {dest}")
    console.print("  score with it: pixrl train ... " + " ".join(f"{k}={v}" for k, v in overrides.items()))
    print(json.dumps(overrides))
