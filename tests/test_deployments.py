"""The Prefect surfaces: typed deployment parameters (the UI's forms), prefect.yaml, and a real
local Prefect server serving the training deployment, triggered through the Prefect client."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import lance
import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect.utilities.callables import parameter_schema
from prefect.utilities.importtools import import_object

from conftest import tiny_overrides
from pixrl.flows.processes import children
from pixrl.flows.deployments import evaluation, offline_dpo_training, online_training

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flow, model, expected", [
    (online_training, "TrainParameters", {"preset": ("string", "shapes_flow_grpo"), "run_name": ("string", "default"),
                                          "iterations": ("integer", 32), "seed": ("integer", 0),
                                          "workdir": ("string", "work"), "overrides": ("array", None)}),
    (offline_dpo_training, "DPOParameters", {"sources": ("array", None), "run_name": ("string", "dpo"),
                                             "steps": ("integer", 200), "workdir": ("string", "work")}),
    (evaluation, "EvalParameters", {"run_name": ("string", None), "alias": ("string", "rollout"),
                                    "split": ("string", "heldout"), "per_category": ("integer", 48)}),
])
def test_parameter_schema_has_types_defaults_and_descriptions(flow, model, expected):
    schema = parameter_schema(flow.fn).model_dump_for_openapi()
    props = schema["definitions"][model]["properties"]
    for name, (typ, default) in expected.items():
        assert props[name]["type"] == typ, name
        if default is not None:
            assert props[name]["default"] == default, name
        assert len(props[name].get("description", "")) > 10, f"{model}.{name} needs a description for the UI form"


def test_prefect_yaml_deploys_the_three_flows_on_a_process_pool():
    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in spec["deployments"]}
    assert set(deps) == {"online", "dpo", "evaluate"}
    names = {}
    for name, d in deps.items():
        path, fn = d["entrypoint"].split(":")
        obj = import_object(f"{(ROOT / path)}:{fn}")
        names[name] = obj.name
        assert d["work_pool"]["name"] == "pixrl-process"
    assert names == {"online": "pixrl-online", "dpo": "pixrl-dpo", "evaluate": "pixrl-evaluate"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "server exited"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"Prefect server at {url} not healthy after {timeout}s")


SERVERS: dict[str, subprocess.Popen] = {}  # API URL → the fixture's server process


@pytest.fixture
def prefect_server(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": url}
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    SERVERS[url] = proc
    try:
        _wait_healthy(url, proc)
        yield url, env
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        del SERVERS[url]


def test_served_training_deployment_runs_from_a_trigger(prefect_server, tiny_checkpoint, tmp_path):
    url, env = prefect_server
    wd = tmp_path / "wd"
    serve = subprocess.Popen([sys.executable, "-c", "from pixrl.cli import app; app()", "serve", "--workdir", str(wd)],
                             env={**env, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        from prefect.client.orchestration import get_client
        from prefect.deployments import run_deployment
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: url}):
            deadline = time.time() + 180
            while True:  # the served deployments appear once `pixrl serve` has registered them
                with get_client(sync_client=True) as client:
                    try:
                        client.read_deployment_by_name("pixrl-online/online")
                        break
                    except Exception:
                        assert serve.poll() is None and time.time() < deadline, serve.stdout.read()
                        time.sleep(1)
            overrides = [o for o in tiny_overrides(tiny_checkpoint, wd) if not o.startswith("run.workdir")]
            params = {"run_name": "ui", "iterations": 1, "seed": 4, "workdir": str(wd),
                      "overrides": ["reward=jpeg_compressibility", *overrides]}
            fr = run_deployment("pixrl-online/online", parameters={"params": params}, timeout=600)
        assert fr.state.is_completed(), fr.state
        assert fr.parameters["params"]["run_name"] == "ui"
    finally:
        os.killpg(serve.pid, 15)
        serve.wait(timeout=30)
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string="tags.`pixrl.run_name` = 'ui'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert json.loads(json.dumps(runs[0].data.params))["run.seed"] == "4"
    assert lance.dataset(str(wd / "lance" / "ui" / "trajectories.lance")).count_rows() == 8


def test_prefect_yaml_deploys_to_a_process_pool_and_a_worker_runs_it(prefect_server, tiny_checkpoint, tmp_path):
    """The path users with a work pool take: `prefect deploy --all` from prefect.yaml registers the
    three deployments (typed parameter schemas included) on a `process` pool, and a worker pulls
    the code from $PIXRL_HOME and runs a triggered training flow to Completed."""
    url, env = prefect_server
    wd = tmp_path / "wd"
    env = {**env, "PIXRL_HOME": str(ROOT)}
    for cmd in (["work-pool", "create", "pixrl-process", "--type", "process"], ["--no-prompt", "deploy", "--all"]):
        out = subprocess.run([sys.executable, "-m", "prefect", *cmd], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}):
        with get_client(sync_client=True) as client:
            deps = {d.name: d for d in client.read_deployments()}
        assert set(deps) == {"online", "dpo", "evaluate"}
        for d in deps.values():
            assert d.work_pool_name == "pixrl-process"
        assert deps["online"].parameter_openapi_schema["definitions"]["TrainParameters"]["properties"]["iterations"][
            "default"] == 32
        overrides = [o for o in tiny_overrides(tiny_checkpoint, wd) if not o.startswith("run.workdir")]
        params = {"run_name": "pooled", "iterations": 1, "workdir": str(wd),
                  "overrides": ["reward=jpeg_compressibility", *overrides]}
        fr = run_deployment("pixrl-online/online", parameters={"params": params}, timeout=0)  # scheduled
        worker = subprocess.run([sys.executable, "-m", "prefect", "worker", "start", "--pool", "pixrl-process",
                                 "--run-once"], env={**env, "PREFECT_WORKER_QUERY_SECONDS": "1"}, cwd=tmp_path,
                                capture_output=True, text=True, timeout=600)
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(fr.id).state
            assert state.is_completed(), (state, worker.stdout[-3000:], worker.stderr[-3000:])
            ml = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
            runs = ml.search_runs([e.experiment_id for e in ml.search_experiments()],
                                  filter_string="tags.`pixrl.run_name` = 'pooled'")
            assert len(runs) == 1 and runs[0].info.status == "FINISHED"
            # the MLflow run belongs to the training subflow of the deployment's flow run
            sub = client.read_flow_run(runs[0].data.tags["prefect.flow_run_id"])
            assert client.read_task_run(sub.parent_task_run_id).flow_run_id == fr.id
    assert lance.dataset(str(wd / "lance" / "pooled" / "trajectories.lance")).count_rows() == 8


def test_serve_stops_on_sigterm_after_its_api_server_has_gone(tmp_path):
    """`pixrl serve` with no API configured starts its own temporary API server; once that server
    is killed, a supervisor's SIGTERM must still stop `pixrl serve` within 10 s (Prefect's own
    graceful stop, and Ctrl-C's, wait on the dead API forever: measured, SIGTERM was ignored)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_RUNNER_POLL_FREQUENCY="1")
    serve = subprocess.Popen([sys.executable, "-c", "from pixrl.cli import app; app()", "serve", "--workdir",
                              str(tmp_path / "wd")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        deadline = time.time() + 180
        while "serving pixrl-online/online" not in (line := serve.stdout.readline()):
            assert line and time.time() < deadline, "pixrl serve did not start"
        time.sleep(3)  # the runner is polling its API
        servers = [p for p in children(serve.pid) if "uvicorn" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(servers) == 1, servers
        os.kill(servers[0], 9)  # its API server dies
        time.sleep(3)
        assert serve.poll() is None
        serve.send_signal(15)
        assert serve.wait(timeout=10) == 143  # raises TimeoutExpired if SIGTERM is ignored
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, 9)
            serve.wait()

