"""The temporary Prefect API server of a local run, started by pixrl at a lower CPU priority.

With no `PREFECT_API_URL`, Prefect starts a temporary API server (uvicorn + SQLite) on first use.
That server wakes up several times a second (its background services, event processing), and on
a machine whose cores the model's threads fill, every wake-up stalls a compute thread: measured
here, an idle server beside the plain-torch loop made it 13% slower (12.6 → 14.2 s/iteration on
2 cores); the same server at nice 19 cost nothing measurable. So a local run starts Prefect's
temporary server itself (the same app and settings; this process's Prefect settings then point
at it) in the background while the run starts up (`begin_local_api`), and lowers its priority when the first
stage's compute begins (`yield_to_compute`; lowered from the start, the server was starved by the
run's imports and the flow's first calls waited for it). Its API calls (task states, artifacts)
come while the model waits, so they are not slowed; only its background work yields to the compute.

`PIXRL_API_SERVER_NICE` sets the increment (default 19; 0 leaves the priority alone). Nothing
happens when an API URL is configured (a `prefect server`, a worker, the test harness) or when
the ephemeral server is disabled.

The server is also watched (`_server_watchdog.py`, Linux): it is stopped at a normal exit,
but after SIGKILL of the run nothing did, and it lived on re-parented to init. The watchdog stops
it within seconds of its owner's death.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
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
    _start["nice"] = _nice_increment()  # a bad PIXRL_API_SERVER_NICE fails here, before anything starts
    server = None
    if not (os.environ.get("PREFECT_API_URL") or ("prefect" in sys.modules and _configured())):
        server = _LocalServer()  # spawned now; whether a profile configures a server is known later

    def run() -> None:
        try:
            _start["url"] = server.ready() if server else None
        except BaseException as exc:  # handed to the caller of start_local_api
            _start["error"] = exc

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


def _configured() -> bool:
    """A server is configured (PREFECT_API_URL from the environment, a profile or a settings
    context such as the test harness), or Prefect's temporary server is switched off."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    return bool(PREFECT_API_URL.value()) or not PREFECT_SERVER_EPHEMERAL_ENABLED.value()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _LocalServer:
    """The app, flags and environment of Prefect's own temporary server (SubprocessASGIServer),
    started without importing `prefect.server` here: that import (FastAPI, SQLAlchemy, every
    route) took ≈5 s of CPU in this process, on a thread that shared the interpreter lock with the
    run's own imports. Once it answers, this process's Prefect settings point at it
    (PREFECT_API_URL, then Prefect's global settings context is refreshed), so every client uses
    it and Prefect starts no second one."""

    APP = "prefect.server.api.server:create_app"
    RESPAWNS = 3  # the picked port was taken before uvicorn bound it

    def __init__(self) -> None:
        self.proc = self._spawn()
        atexit.register(self.stop)  # after _watch's registration: runs first (LIFO)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def _spawn(self) -> subprocess.Popen:
        self.port = _free_port()
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env.update(PREFECT_UI_ENABLED="0", PREFECT__SERVER_EPHEMERAL="1", PREFECT__SERVER_FINAL="1")
        site = Path(importlib.util.find_spec("prefect").origin).parent.parent  # finds, does not import
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--app-dir", str(site), "--factory", self.APP,
                                 "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error",
                                 "--lifespan", "on"], env=env)
        _start["server"] = proc.pid
        _watch(proc.pid)
        return proc

    def ready(self) -> str | None:
        """The URL once /health answers; None (and the server stopped) when a server is configured."""
        if _configured():
            self.stop()
            _start.pop("server", None)  # nothing of ours to renice
            return None
        from prefect.context import refresh_global_settings_context
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

        timeout = float(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
        deadline, respawns = time.monotonic() + timeout, 0
        while not _healthy(self.url):
            if self.proc.poll() is not None:
                respawns += 1
                if respawns > self.RESPAWNS:
                    raise RuntimeError(f"the temporary Prefect API server exited (code {self.proc.returncode}) "
                                       f"{respawns} times; start one with `prefect server start` and set "
                                       f"PREFECT_API_URL=http://127.0.0.1:4200/api")
                self.proc = self._spawn()
            elif time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the temporary Prefect API server did not answer within {timeout:.0f} s "
                                   f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS); start one with "
                                   f"`prefect server start` and set PREFECT_API_URL=http://127.0.0.1:4200/api")
            time.sleep(0.05)
        os.environ["PREFECT_API_URL"] = self.url
        refresh_global_settings_context()
        return self.url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:  # refused while uvicorn starts; URLError and timeouts are OSErrors
        return False


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

    def _stop() -> None:  # runs after the server's own atexit stop (LIFO)
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
