"""pixrl command line (`pixrl = pixrl.cli:app`): the app and its commands, one module per kind."""

from . import catalog, mediapipe, runs, score, tools, vllm  # noqa: F401,E402  (register the commands)
from .app import app, main

__all__ = ["app", "main"]
