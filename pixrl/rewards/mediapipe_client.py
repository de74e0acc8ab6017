"""A mediapipe worker process (rewards/mediapipe_worker.py) run by the interpreter of mediapipe's
own environment, shared by the face and pose rewards of one process: started once, on the first
score, and kept; a worker that dies fails the score naming the interpreter and what it printed,
and the next score starts a new one."""

from __future__ import annotations

import atexit
import io
import json
import os
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from .base import ScoringError

WORKER = Path(__file__).with_name("mediapipe_worker.py")
DEFAULT_VENV = ".venv-mediapipe"
SETUP_HINT = "make it with `pixrl setup-mediapipe` (or set PIXRL_MEDIAPIPE_PYTHON / reward.options.NAME.python)"


def default_python() -> str:
    return os.environ.get("PIXRL_MEDIAPIPE_PYTHON") or str(Path(DEFAULT_VENV) / "bin" / "python")


class MediapipeWorker:
    _shared: dict[str, "MediapipeWorker"] = {}

    @classmethod
    def of(cls, python: str) -> "MediapipeWorker":
        key = str(Path(python).absolute())
        if key not in cls._shared:
            cls._shared[key] = cls(key)
        return cls._shared[key]

    def __init__(self, python: str):
        self.python, self.proc, self.version = python, None, None
        self.lock = threading.Lock()  # one request at a time on the pipe (overlap's thread and the main one)
        self.log = tempfile.TemporaryFile()
        atexit.register(self.close)

    def _log_tail(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").strip().splitlines()
        useful = [ln for ln in lines if "Feedback manager" not in ln and "XNNPACK" not in ln]
        return " | ".join(useful[-5:]) or "(nothing on stderr)"

    def _read(self):
        head = self.proc.stdout.read(4)
        if len(head) < 4:
            self.proc.wait(timeout=10)
            raise ScoringError(f"the mediapipe worker ({self.python}) exited with code {self.proc.returncode}: "
                               f"{self._log_tail()}")
        (n,) = struct.unpack(">I", head)
        return json.loads(self.proc.stdout.read(n))

    def start(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                return
            code, self.proc = self.proc.returncode, None  # died between requests: say so; the next call restarts
            raise ScoringError(f"the mediapipe worker ({self.python}) exited with code {code}: {self._log_tail()}")
        self.log.seek(0)
        self.log.truncate()
        try:
            self.proc = subprocess.Popen([self.python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self.log)
        except OSError as exc:
            raise ScoringError(f"could not start the mediapipe worker with {self.python}: {exc}; {SETUP_HINT}") from None
        hello = self._read()
        if "ready" not in hello:
            self.close()
            raise ScoringError(f"{self.python} cannot run mediapipe ({hello.get('error')}); {SETUP_HINT}")
        self.version = hello["ready"]

    def call(self, task: str, images: np.ndarray, **options) -> list:
        """One request: per image, what the worker's `task` returns."""
        buf = io.BytesIO()
        np.savez(buf, images=np.ascontiguousarray(images, dtype=np.uint8),
                 request=np.array(json.dumps({"task": task, **options})))
        body = buf.getvalue()
        with self.lock:
            self.start()
            try:
                self.proc.stdin.write(struct.pack(">I", len(body)) + body)
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # the read below names the exit code and the worker's last words
            try:
                reply = self._read()
            except ScoringError:
                self.proc = None
                raise
        if "error" in reply:
            raise ScoringError(f"the mediapipe worker ({self.python}) failed a {task} request: {reply['error']}")
        if len(reply["results"]) != len(images):
            raise ScoringError(f"the mediapipe worker answered {len(reply['results'])} results for {len(images)} images")
        return reply["results"]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None
