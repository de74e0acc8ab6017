"""The temporary Prefect API server of a local run, started by pixrl at a lower CPU priority.

With no `PREFECT_API_URL`, Prefect starts a temporary API server (uvicorn + SQLite) on first use.
That server wakes up several times a second (its background services, event processing), and on
a machine whose cores the model's threads fill, every wake-up stalls a compute thread: measured
here, an idle server beside the plain-torch loop made it 13% slower (12.6 → 14.2 s/iteration on
2 cores); the same server at nice 19 cost nothing measurable. So a local run starts Prefect's
own temporary server itself — the same singleton Prefect's clients then find and use — in the
background while the run starts up (`begin_local_api`), and lowers its priority when the first
stage's compute begins (`yield_to_compute`; lowered from the start, the server was starved by the
run's imports and the flow's first calls waited for it). Its API calls (task states, artifacts)
come while the model waits, so they are not slowed; only its background work yields to the compute.

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
import threading
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_NICE = 19


_start: dict[str, object] = {}  # "thread", "url", "error", "server": the one start of this process


def begin_local_api() -> None:
    """Start the temporary API server in the background (once per process), so that its start-up
    (uvicorn, its SQLite database) overlaps the run's own (imports, preflight, the model): the CLI
    calls this as soon as the config is read and `start_local_api` waits for it before the flow.
    The server runs at normal priority until `yield_to_compute`: at nice 19 from the start it was
    starved by the run's imports, and the flow's first API calls waited for it."""
    if "thread" in _start:
        return
    nice = _nice_increment()  # a bad PIXRL_API_SERVER_NICE fails here, before anything starts

    def run() -> None:
        try:
            _start["url"] = _start_server()
        except BaseException as exc:  # handed to the caller of start_local_api
            _start["error"] = exc

    _start["nice"] = nice
    t = threading.Thread(target=run, name="pixrl-api-server-start", daemon=True)
    _start["thread"] = t
    t.start()


def start_local_api() -> str | None:
    """The temporary API server's URL once it answers (started now unless `begin_local_api` began
    it), or None when the run uses a configured server."""
    begin_local_api()
    _start["thread"].join()
    if "error" in _start:
        raise _start["error"]
    return _start.get("url")


def _start_server() -> str | None:
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the singleton Prefect's get_client() uses in ephemeral mode
    server.start()
    if server.server_process is not None:
        _start["server"] = server.server_process.pid
        _watch(server.server_process.pid)
    return server.api_url


def yield_to_compute() -> None:
    """Lower the temporary server's priority (`PIXRL_API_SERVER_NICE`, default 19) for the rest of
    the run: called when the first stage's compute begins. Idempotent; nothing for a configured
    server. (An unprivileged process can lower a priority, never raise it back.)"""
    pid, nice = _start.get("server"), _start.get("nice")
    if not pid or not nice or _start.get("yielded"):
        return
    _start["yielded"] = True
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
    except (OSError, AttributeError) as exc:  # not permitted, or not a POSIX system: run as is
        log.warning("could not lower the priority of the Prefect API server (pid %s): %s", pid, exc)


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
