"""One writer per run (artifacts/run_lock.py) and a race-free first use of the MLflow store."""

import json
import logging
import os
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.artifacts.run_lock import RunLock, RunLocked
from pixrl.cli import app

HOLDER = """
import sys, time
from pixrl.artifacts.run_lock import RunLock
lock = RunLock(sys.argv[1], sys.argv[2])
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def _hold(workdir, run) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir), run], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_writer_is_refused_naming_the_owner(tmp_path):
    p = _hold(tmp_path, "A")
    try:
        with pytest.raises(RunLocked) as err:
            RunLock(tmp_path, "A").acquire()
        msg = str(err.value)
        assert f"pid {p.pid}" in msg and "'A'" in msg and str(tmp_path.resolve()) in msg and "--run" in msg
        with RunLock(tmp_path, "B"):  # another run of the same work directory is free
            pass
    finally:
        p.kill()
        p.wait()


def test_a_stale_lock_is_taken_over_with_a_notice(tmp_path, caplog):
    p = _hold(tmp_path, "A")
    p.send_signal(signal.SIGKILL)  # dies holding it: the kernel drops the flock, the file still names it
    p.wait()
    assert json.loads((tmp_path / "locks" / "A.lock").read_text())["pid"] == p.pid
    with caplog.at_level(logging.WARNING, logger="pixrl.artifacts.run_lock"):
        with RunLock(tmp_path, "A"):
            assert json.loads((tmp_path / "locks" / "A.lock").read_text())["pid"] == os.getpid()
    assert any(f"pid {p.pid}" in r.getMessage() and "taking over" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "locks" / "A.lock").read_text() == ""  # released cleanly: nothing to take over


def test_the_lock_is_reentrant_in_one_process_and_free_after_release(tmp_path):
    outer, inner = RunLock(tmp_path, "A"), RunLock(tmp_path, "A")
    with outer:
        with inner:
            pass
        other = subprocess.run([sys.executable, "-c", HOLDER.replace("time.sleep(600)", ""), str(tmp_path), "A"],
                               capture_output=True, text=True)
        assert other.returncode != 0 and "RunLocked" in other.stderr  # still held by the outer holder
    p = _hold(tmp_path, "A")  # released: another process takes it
    p.kill()
    p.wait()


def test_two_trainings_of_one_run_one_is_refused(tiny_checkpoint, tmp_path, prefect_harness):
    p = _hold(tmp_path, "same")  # a live writer of run `same` in this work directory
    try:
        res = CliRunner().invoke(app, ["train", "-n", "1", "--run", "same", "reward=jpeg_compressibility",
                                       *tiny_overrides(tiny_checkpoint, tmp_path)])
        assert res.exit_code == 1 and f"pid {p.pid}" in res.output, res.output
        assert "Traceback" not in res.output
        assert not (tmp_path / "lance" / "same").exists()  # refused before anything of the run was written
        if (tmp_path / "mlflow.db").exists():
            from mlflow.tracking import MlflowClient

            client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
            exps = [e.experiment_id for e in client.search_experiments()]
            assert not client.search_runs(exps, filter_string="tags.`pixrl.run_name` = 'same'")
    finally:
        p.kill()
        p.wait()


STORE = """
import sys
from pixrl.artifacts.tracking import Tracker
t = Tracker(sys.argv[1])
t.client.search_experiments()
t.client.search_registered_models()
"""


def test_two_processes_creating_a_fresh_mlflow_store_both_succeed(tmp_path):
    for attempt in range(3):
        uri = f"sqlite:///{tmp_path / f'store{attempt}' / 'mlflow.db'}"
        procs = [subprocess.Popen([sys.executable, "-c", STORE, uri], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
