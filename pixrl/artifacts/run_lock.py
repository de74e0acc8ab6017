"""One writer per run: a lock per (work directory, run name), so two processes never train,
resume or replay-into the same run's stores at once.

The lock is an OS file lock (`flock`) on `<workdir>/locks/<run>.lock`, whose content names the
owner (host, PID, start time) for the refusal message. The kernel releases a `flock` when its
holder dies however it dies (SIGKILL included), so a lock file that still names an owner but is
not locked was left by a dead process: it is taken over, with a notice. (`flock` is per host;
on a filesystem shared between hosts, one host's runs are not seen by another's.)
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from ..errors import ExpectedError

log = logging.getLogger(__name__)


class RunLocked(ExpectedError, RuntimeError):
    """Another live process holds the run."""


_held: dict[Path, tuple[int, int]] = {}  # path → (fd, depth): re-entrant within one process


def _owner_text(owner: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
    return f"pid {owner.get('pid')} on {owner.get('host')} (started {started}: {owner.get('command', '?')})"


def _read_owner(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 65536)
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {}


class RunLock:
    """`with RunLock(workdir, run):` — held for the body; refused with RunLocked if taken."""

    def __init__(self, workdir: Path | str, run_name: str):
        self.workdir = Path(workdir).resolve()
        self.run_name = run_name
        self.path = self.workdir / "locks" / f"{run_name}.lock"

    def acquire(self) -> None:
        if self.path in _held:
            fd, depth = _held[self.path]
            _held[self.path] = (fd, depth + 1)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(fd)
            os.close(fd)
            raise RunLocked(f"run {self.run_name!r} in {self.workdir} is being written by {_owner_text(owner)}; "
                            f"wait for it to finish, stop it (kill -TERM {owner.get('pid', '<pid>')}), or choose "
                            f"another --run") from None
        previous = _read_owner(fd)
        if previous:
            log.warning("taking over the lock of run %r: it names %s, which is gone (it did not release it)",
                        self.run_name, _owner_text(previous))
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
              "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(me).encode())
        os.fsync(fd)
        _held[self.path] = (fd, 1)

    def release(self) -> None:
        fd, depth = _held.get(self.path, (None, 0))
        if fd is None:
            return
        if depth > 1:
            _held[self.path] = (fd, depth - 1)
            return
        del _held[self.path]
        os.ftruncate(fd, 0)  # an empty lock file: released cleanly, nothing to take over
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
