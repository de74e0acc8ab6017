"""`pixrl setup-vllm`: vLLM's own environment. vLLM pins torch, transformers and fastapi versions
that clash with Prefect's, so it never enters pixrl's environment: it gets a virtual environment of
its own, from which `vllm serve` serves a judge (the `vlm_judge` reward's vllm backend) over its
OpenAI-compatible API, on this machine or a GPU node."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .app import app, console
from .side_env import make_side_env

VLLM_VERSION = "0.33.0"  # ecosystem.md: pins torch 2.14 (CUDA 13), transformers <5.21, fastapi <0.137


def serve_hint(python: Path, model: str = "CHECKOUT") -> str:
    return (f"{python.parent / 'vllm'} serve {model} --max-logprobs 20 --port 8000\n"
            f"pixrl train … reward=… reward.options.vlm_judge.backend=vllm "
            f"reward.options.vlm_judge.url=http://127.0.0.1:8000")


@app.command("setup-vllm")
def setup_vllm(
    venv: str = typer.Option(".venv-vllm", help="where the environment goes (outside pixrl's own)"),
    version: str = typer.Option(VLLM_VERSION, help="vLLM release to install"),
    python: str = typer.Option(sys.executable, help="the interpreter to base it on (the same minor version as "
                                                    "pixrl's when the judge runs as a Ray actor)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the commands only"),
) -> None:
    """Make vLLM's own virtual environment and print how to serve a judge from it."""
    py = make_side_env(Path(venv), python, [f"vllm=={version}"], "vLLM",
                       "vLLM needs Linux with a CUDA GPU and Python 3.9–3.12 (see its install notes)", dry_run)
    target = py.parent.parent
    console.print(f"vLLM {version} {'would be' if dry_run else 'is'} in {target}. Serve a judge with:\n"
                  + serve_hint(py))
