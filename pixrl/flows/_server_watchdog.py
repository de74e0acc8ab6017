"""Stops the temporary Prefect API server once the pixrl process that started it is gone — also
after SIGKILL, which no atexit or signal handler of that process sees (issue: every killed run
left a uvicorn server behind, re-parented to init, holding memory and a port).

Run by path, not as a package module, so it imports nothing but the standard library:

    python _server_watchdog.py OWNER_PID SERVER_PID

It is a child of the owner: when the owner dies it is re-parented, `os.getppid()` changes, and it
stops the server (SIGTERM, then SIGKILL after 5 s). It exits by itself when the server is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.5
GRACE_S = 5.0


def _is_server(pid: int) -> bool:
    """The process is alive and is still the uvicorn serving Prefect (not a reused PID)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z" and b"uvicorn" in cmd and b"prefect" in cmd


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal is the owner's to handle
    owner, server = int(sys.argv[1]), int(sys.argv[2])
    while os.getppid() == owner:
        if not _is_server(server):
            return  # stopped by its owner (or never started): nothing to watch
        time.sleep(POLL_S)
    if not _is_server(server):
        return
    os.kill(server, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        if not _is_server(server):
            return
        time.sleep(0.1)
    if _is_server(server):
        os.kill(server, signal.SIGKILL)


if __name__ == "__main__":
    main()
