"""A package whose pins clash with pixrl's (mediapipe, vLLM) gets a virtual environment of its
own: `make_side_env` creates it and installs the package there, refusing pixrl's own environment
as the target and naming the failed command and the platform limits on a failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .app import _fail, console


def make_side_env(target: Path, python: str, install: list[str], what: str, platforms: str,
                  dry_run: bool = False) -> Path:
    """Create the environment at `target` from `python` and run `pip install *install` in it;
    returns its interpreter. `what` names the package for messages, `platforms` says where its
    wheels exist (the hint after a failed step)."""
    target = target.absolute()
    if Path(sys.prefix).resolve() == target.resolve():
        _fail(f"--venv {target} is pixrl's own environment; {what}'s pins would break it — choose another folder")
    py = target / "bin" / "python"
    for cmd in ([python, "-m", "venv", str(target)], [str(py), "-m", "pip", "install", "-q", *install]):
        console.print("$ " + " ".join(cmd))
        if dry_run:
            continue
        done = subprocess.run(cmd)
        if done.returncode:
            _fail(f"`{' '.join(cmd[:6])} …` exited {done.returncode}; {platforms}; nothing else was changed")
    return py
