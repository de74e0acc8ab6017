"""The temporary Prefect API server of a local run, started by pixrl at a lower CPU priority.

With no `PREFECT_API_URL`, Prefect starts a temporary API server (uvicorn + SQLite) on first use.
That server wakes up several times a second (its background services, event processing), and on
a machine whose cores the model's threads fill, every wake-up stalls a compute thread: measured
here, an idle server beside the plain-torch loop made it 13% slower (12.6 → 14.2 s/iteration on
2 cores); the same server at nice 19 cost nothing measurable. So a local run starts Prefect's
own temporary server itself — the same singleton Prefect's clients then find and use — and
lowers its priority. Its API calls (task states, artifacts) come while the model waits, so they
are not slowed; only its background work yields to the compute.

`PIXRL_API_SERVER_NICE` sets the increment (default 19; 0 leaves the priority alone). Nothing
happens when an API URL is configured (a `prefect server`, a worker, the test harness) or when
the ephemeral server is disabled.

The server is also watched (`_server_watchdog.py`, Linux): Prefect stops it at a normal exit,
but after SIGKILL of the run nothing did, and it lived on re-parented to init. The watchdog stops
it within seconds of its owner's death.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_NICE = 19


def start_local_api() -> str | None:
    """Start (once per process) the temporary API server at lowered priority; return its URL,
    or None when the run uses a configured server."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the singleton Prefect's get_client() uses in ephemeral mode
    server.start()
    nice = _nice_increment()
    if nice and server.server_process is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, server.server_process.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
        except (OSError, AttributeError) as exc:  # not permitted, or not a POSIX system: run as is
            log.warning("could not lower the priority of the Prefect API server (pid %s): %s",
                        server.server_process.pid, exc)
    if server.server_process is not None:
        _watch(server.server_process.pid)
    return server.api_url


_watchdogs: dict[int, subprocess.Popen] = {}


def _watch(server_pid: int) -> None:
    """A watchdog process per server: it stops the server once this process is gone."""
    if server_pid in _watchdogs or not sys.platform.startswith("linux"):
        return
    dog = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_server_watchdog.py")), str(os.getpid()),
                            str(server_pid)], stdin=subprocess.DEVNULL, start_new_session=True)
    _watchdogs[server_pid] = dog

    def _stop() -> None:  # runs before Prefect's own atexit stop of the server (LIFO)
        dog.terminate()
        dog.wait()

    atexit.register(_stop)


def _nice_increment() -> int:
    raw = os.environ.get("PIXRL_API_SERVER_NICE", str(DEFAULT_NICE))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"PIXRL_API_SERVER_NICE={raw!r} is not an integer; set 0–19 (0 leaves the Prefect API "
                         f"server's priority alone)") from None
    if not 0 <= value <= 19:
        raise ValueError(f"PIXRL_API_SERVER_NICE={value} is outside 0–19 (a niceness increment)")
    return value
