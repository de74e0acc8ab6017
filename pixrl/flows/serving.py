"""`pixrl serve`: the deployments served from this process by a Prefect Runner, stoppable by a
process supervisor whatever state the API server is in.

Prefect's Runner answers SIGTERM with a graceful stop that talks to the API (pausing the served
deployments, cancelling in-flight runs). Once the API server has gone (measured: `pixrl serve`'s
own temporary server killed), neither that stop nor Ctrl-C's ever finished, and SIGTERM was
ignored. Here SIGTERM first asks the API for its health (1 s):
- unreachable: the flow runs this process started get SIGTERM (they end as interrupted runs,
  resumable), and the process exits at once with status 143 (128 + SIGTERM);
- reachable: the path Ctrl-C takes (asyncio's SIGINT handling cancels the runner, which pauses
  and cancels through the API), and a process still alive `STOP_DEADLINE_S` later exits anyway.
A second SIGTERM exits at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import urllib.request

from .processes import children

STOP_DEADLINE_S = 8.0
_API: dict[str, str | None] = {"url": None}


def _exit_now(*_args) -> None:
    os._exit(128 + signal.SIGTERM)


def api_reachable(url: str | None, timeout: float = 1.0) -> bool:
    """Whether the Prefect API at `url` answers /health within `timeout` seconds."""
    if not url:
        return False
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def _stop(*_args) -> None:
    """SIGTERM, on the main thread; the health check runs beside it so the handler never blocks."""
    signal.signal(signal.SIGTERM, _exit_now)

    def decide() -> None:
        if not api_reachable(_API["url"]):
            for pid in children(os.getpid()):  # in-flight flow runs end as interrupted (their own SIGTERM handling)
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
            _exit_now()
        timer = threading.Timer(STOP_DEADLINE_S, _exit_now)
        timer.daemon = True
        timer.start()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=decide, name="pixrl-serve-stop", daemon=True).start()


def serve(*deployments, api_url: str | None = None, limit: int | None = None) -> None:
    """Serve `deployments` (RunnerDeployment) against the API at `api_url` until SIGINT or SIGTERM."""
    from prefect.runner import Runner

    class _Runner(Runner):
        def handle_sigterm(self, *args, **kwargs) -> None:  # installed by Runner.start on the main thread
            _stop()

    _API["url"] = api_url
    runner = _Runner(pause_on_shutdown=True, limit=limit)
    for d in deployments:
        runner.add_deployment(d)
    names = ", ".join(f"{d.flow_name}/{d.name}" for d in deployments)
    print(f"serving {names} (API {api_url}); trigger runs from the Prefect UI or `prefect deployment run NAME`; "
          f"Ctrl-C stops", flush=True)
    try:
        asyncio.run(runner.start())
    except KeyboardInterrupt:
        pass
