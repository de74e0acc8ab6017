"""The temporary Prefect API server of a local run (pixrl/flows/api_server.py): started in the
background at normal priority, lowered to nice 19 when the compute begins, stopped with the run."""

import json
import os
import subprocess
import sys

from pixrl.flows.processes import alive

SCRIPT = """
import json, os, sys, time
from pixrl.flows import api_server
t0 = time.time()
api_server.begin_local_api()
began = time.time() - t0                      # returns at once: the start runs in the background
url = api_server.start_local_api()            # waits until the server answers
pid = api_server._start["server"]
before = os.getpriority(os.PRIO_PROCESS, pid)
api_server.yield_to_compute()
api_server.yield_to_compute()                 # idempotent
after = os.getpriority(os.PRIO_PROCESS, pid)
print(json.dumps({"began_s": began, "url": url, "pid": pid, "before": before, "after": after,
                  "me": os.getpriority(os.PRIO_PROCESS, 0)}))
"""


def _run_fresh(code: str, tmp_path) -> dict:
    """Run `code` in a new process with no configured server and its own Prefect home; its JSON line."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_server_starts_in_the_background_then_yields_and_stops_with_the_process(tmp_path):
    info = _run_fresh(SCRIPT, tmp_path)
    assert info["url"].startswith("http://127.0.0.1:") and info["began_s"] < 1.0
    assert info["before"] == info["me"]  # normal priority while the run starts up
    assert info["after"] == min(19, info["me"] + 19)  # then nice 19 for the rest of the run
    assert not alive(info["pid"])  # stopped when the process exited


def test_a_bad_nice_setting_fails_before_anything_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PIXRL_API_SERVER_NICE="high")
    out = subprocess.run([sys.executable, "-c", "from pixrl.flows import api_server; api_server.begin_local_api()"],
                         env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0 and "PIXRL_API_SERVER_NICE='high' is not an integer" in out.stderr
    assert not (tmp_path / "prefect-home").exists() or not any((tmp_path / "prefect-home").rglob("*.db"))


POINTED = """
import json, sys
from pixrl.flows import api_server
url = api_server.start_local_api()
from prefect.settings import PREFECT_API_URL
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    healthy = client.api_healthcheck() is None
print(json.dumps({"url": url, "setting": PREFECT_API_URL.value(), "healthy": healthy,
                  "server_module_here": "prefect.server.api.server" in sys.modules}))
"""


def test_this_process_points_prefect_at_the_server_it_started_without_importing_it(tmp_path):
    """Prefect's clients use the server pixrl started (no second temporary server), and the run's
    process never imports prefect.server (≈5 s of CPU that competed with the run's own imports)."""
    info = _run_fresh(POINTED, tmp_path)
    assert info["setting"] == info["url"] and info["healthy"]
    assert not info["server_module_here"]


def test_a_configured_server_is_used_and_none_is_started(tmp_path):
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api", "PREFECT_HOME": str(tmp_path / "home")}
    code = ("import json; from pixrl.flows import api_server; url = api_server.start_local_api(); "
            "print(json.dumps({'url': url, 'server': api_server._start.get('server')}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"url": None, "server": None}
