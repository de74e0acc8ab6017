"""`pixrl setup-mediapipe`: the face and pose rewards' own environment. mediapipe 0.10.21 — the
last release whose wheel ships its TFLite models — pins numpy < 2 and protobuf < 5, which pixrl's
environment (numpy 2, protobuf ≥ 5 for MLflow/OpenTelemetry) cannot hold; the rewards run it in a
worker process with this environment's interpreter. Only what the legacy solutions import is
installed (not jax or opencv-contrib): about 440 MB, 10 s from the registry."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ..rewards.mediapipe_client import DEFAULT_VENV
from .app import app, console
from .side_env import make_side_env

PACKAGES = ["mediapipe==0.10.21", "absl-py==2.5.1", "attrs==26.1.0", "flatbuffers==25.12.19", "numpy==1.26.4",
            "protobuf==4.25.9", "opencv-python-headless==4.14.0.94", "matplotlib==3.11.2", "contourpy==1.3.3",
            "cycler==0.12.1", "fonttools==4.68.0", "kiwisolver==1.5.1", "packaging", "pillow", "pyparsing",
            "python-dateutil", "six"]


@app.command("setup-mediapipe")
def setup_mediapipe(
    venv: str = typer.Option(DEFAULT_VENV, help="where the environment goes (outside pixrl's own)"),
    python: str = typer.Option(sys.executable, help="the interpreter to base it on (3.9–3.12)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the commands only"),
) -> None:
    """Make mediapipe's own virtual environment for the face and pose rewards."""
    py = make_side_env(Path(venv), python, ["--no-deps", *PACKAGES], "mediapipe",
                       "mediapipe 0.10.21 has wheels for CPython 3.9–3.12 on Linux x86-64/aarch64, macOS and "
                       "Windows", dry_run)
    target = py.parent.parent
    console.print(f"mediapipe {'would be' if dry_run else 'is'} in {target}. The face and pose rewards find it there "
                  f"from this folder; elsewhere set PIXRL_MEDIAPIPE_PYTHON={py}")
