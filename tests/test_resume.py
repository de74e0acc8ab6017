"""Resume after a failure in any stage: completed stages are skipped, the MLflow run is
reattached, no Lance row is duplicated, and the final weights are bit-identical to an
uninterrupted run (CPU fp32)."""

import json
import os
import signal
import subprocess
import sys
import time

import lance
import pytest
from conftest import train_args
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from typer.testing import CliRunner

from pixrl.artifacts.checkpoints import verify_checkpoint
from pixrl.cli import app
from pixrl.flows.processes import alive, children
from pixrl.stages.chaos import ENV

STAGES = ["generate", "decode", "score", "replay", "update", "publish"]


def _train(ckpt, wd, run):
    return CliRunner().invoke(app, train_args(ckpt, wd, run))


def _final_weights(wd, run, run_id):
    return load_file(str(wd / "checkpoints" / run / run_id / "it_0001" / "trainable.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tiny_checkpoint, tmp_path_factory, prefect_harness):
    wd = tmp_path_factory.mktemp("ref")
    res = _train(tiny_checkpoint, wd, "ref")
    assert res.exit_code == 0, res.output
    run_id = json.loads(res.stdout.strip().splitlines()[-1])["run_id"]
    return _final_weights(wd, "ref", run_id)


def check_resumed_run(wd, run, run_id, reference):
    """Everything a resumed 2-iteration run must show, whatever interrupted it."""
    new = _final_weights(wd, run, run_id)
    assert all(new[k].equal(reference[k]) for k in reference), "resumed weights differ"

    ds = lance.dataset(str(wd / "lance" / run / "trajectories.lance"))
    t = ds.to_table(columns=["sample_id", "iteration", "advantage"])
    assert t.num_rows == 16 and len(set(zip(t["iteration"].to_pylist(), t["sample_id"].to_pylist()))) == 16
    assert t["advantage"].null_count == 0
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "FINISHED"
    assert len(client.search_runs([client.get_experiment_by_name("pixrl").experiment_id])) == 1
    for key in ("images_per_s", "decode_compute_s", "reward/reward/mean", "zero_std_ratio", "loss",
                "policy_version", *(f"time/{s}_s" for s in STAGES if s != "publish")):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [0, 1], key
    versions = sorted(int(v.version) for v in client.search_model_versions("name='pixrl-policy'"))
    assert versions == [1, 2]
    alias = client.get_model_version_by_alias("pixrl-policy", "rollout")
    assert int(alias.version) == 2
    verify_checkpoint(wd / "checkpoints" / run / run_id / "it_0001")  # the alias target is complete


@pytest.mark.parametrize("stage", STAGES)
def test_resume_after_exception_is_bit_identical(stage, tiny_checkpoint, tmp_path, monkeypatch, uninterrupted):
    monkeypatch.setenv(ENV, f"{stage}@1:raise")
    wd = tmp_path / "wd"
    res = _train(tiny_checkpoint, wd, "A")
    assert res.exit_code == 1 and f"injected fault in {stage}" in res.output
    monkeypatch.delenv(ENV)
    res = CliRunner().invoke(app, ["resume", "A", "--workdir", str(wd)])
    assert res.exit_code == 0, res.output
    assert "(done before)" in res.output
    run_id = json.loads(res.stdout.strip().splitlines()[-1])["run_id"]
    check_resumed_run(wd, "A", run_id, uninterrupted)


def _cli_process(args, env_extra, **kw):
    """`pixrl ...` as its own process, talking to the test's Prefect server."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), **env_extra}
    env.pop(ENV, None) if ENV not in env_extra else None
    return subprocess.Popen([sys.executable, "-c", "from pixrl.cli import app; app()", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _resume_process(wd, run):
    p = _cli_process(["resume", run, "--workdir", str(wd)], {})
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])["run_id"]


@pytest.mark.parametrize("stage", STAGES)
def test_resume_after_sigkill_is_bit_identical(stage, tiny_checkpoint, tmp_path, uninterrupted):
    """The process dies mid-stage (after its work, before its commit) with no chance to clean up."""
    wd = tmp_path / "wd"
    p = _cli_process(train_args(tiny_checkpoint, wd, "K"), {ENV: f"{stage}@1:sigkill"})
    out, _ = p.communicate(timeout=600)
    assert p.returncode == -signal.SIGKILL, out
    run_id = _resume_process(wd, "K")
    check_resumed_run(wd, "K", run_id, uninterrupted)


def test_sigkill_from_outside_at_an_arbitrary_moment(tiny_checkpoint, tmp_path):
    """`pixrl train -n 3` killed by SIGKILL while iteration 1 is under way, then `pixrl resume`,
    publishes the same final weights as an uninterrupted run."""
    ref = tmp_path / "ref"
    p = _cli_process(train_args(tiny_checkpoint, ref, "A", iterations=3), {})
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    ref_id = json.loads(out.strip().splitlines()[-1])["run_id"]

    wd = tmp_path / "wd"
    p = _cli_process(train_args(tiny_checkpoint, wd, "A", iterations=3), {}, start_new_session=True)
    deadline = time.time() + 300
    while not list((wd / "records" / "A").glob("*/it_0001/decode.json")):  # iteration 1 is under way
        assert p.poll() is None and time.time() < deadline, "training ended before it could be killed"
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    run_id = _resume_process(wd, "A")
    final = lambda w, rid: load_file(str(w / "checkpoints" / "A" / rid / "it_0002" / "trainable.safetensors"))
    want, got = final(ref, ref_id), final(wd, run_id)
    assert all(got[k].equal(want[k]) for k in want), "resumed weights differ from the uninterrupted run"


# --- interrupts from outside: SIGTERM stops cleanly, SIGKILL leaves no child behind -----------------

def _children(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is `pid`."""
    return [c for c in children(pid) if alive(c)]


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if alive(p)]


def _own_server_process(args, tmp_path, env_extra):
    """`pixrl ...` with no configured Prefect API: it starts (and must stop) its own server."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", ENV)}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), **env_extra})
    return subprocess.Popen([sys.executable, "-c", "from pixrl.cli import app; app()", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for(path_glob, wd, p, timeout=300):
    deadline = time.time() + timeout
    while not list(wd.glob(path_glob)):
        assert p.poll() is None and time.time() < deadline, p.communicate()[0][-3000:] if p.poll() is not None else "timeout"
        time.sleep(0.1)


def test_sigterm_during_update_stops_cleanly_and_resumes_bit_identical(tiny_checkpoint, tmp_path, uninterrupted):
    wd = tmp_path / "wd"
    p = _own_server_process(train_args(tiny_checkpoint, wd, "T"), tmp_path, {ENV: "update@1:stall"})
    _wait_for("records/T/*/it_0001/update.json", wd, p)  # the update computed, stalled before its commit
    kids = _children(p.pid)
    assert kids, "the run started no Prefect API server"
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert time.time() - t0 < 10 and p.returncode == 130, out[-3000:]
    assert "pixrl resume T" in out and "Traceback" not in out
    assert "INFO mlflow" not in out and "alembic" not in out  # no third-party INFO amid the progress lines
    deadline = time.time() + 10
    while _alive(kids) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(kids), f"children still alive after SIGTERM: {_alive(kids)}"
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pixrl").experiment_id])
    assert run.info.status == "KILLED"
    assert not list((wd / "checkpoints" / "T" / run.info.run_id).glob("it_0001*")), "the interrupted update committed"
    assert (wd / "locks" / "T.lock").read_text() == "", "the run's lock was not released"
    run_id = _resume_process(wd, "T")
    assert run_id == run.info.run_id
    check_resumed_run(wd, "T", run_id, uninterrupted)


def test_sigkill_of_the_run_leaves_no_child_alive(tiny_checkpoint, tmp_path):
    wd = tmp_path / "wd"
    p = _own_server_process(train_args(tiny_checkpoint, wd, "K2"), tmp_path, {ENV: "decode@0:stall"})
    _wait_for("records/K2/*/it_0000/decode.json", wd, p)
    kids = _children(p.pid)
    assert kids, "the run started no Prefect API server"
    os.kill(p.pid, signal.SIGKILL)  # the main process only, as the OOM killer would
    p.communicate(timeout=30)
    deadline = time.time() + 10
    while _alive(kids) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(kids), f"children outlived the killed run: {_alive(kids)}"


def test_an_interrupt_anywhere_in_the_exception_chain_ends_the_run_killed():
    from prefect.exceptions import TerminationSignal

    from pixrl.flows.interrupts import end_status

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as k:
            raise RuntimeError("a task crashed") from k
    except RuntimeError as wrapped:
        assert end_status(wrapped) == "KILLED"
    assert end_status(TerminationSignal(signal.SIGTERM)) == "KILLED"
    assert end_status(ValueError("bad config")) == "FAILED"
