"""Transient faults are retried with backoff where a retry is safe; deterministic errors fail
on the first attempt with their message (real Prefect task runs, counted by the server)."""

import errno
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.artifacts.checkpoints import CorruptCheckpoint
from pixrl.cli import app
from pixrl.config.loader import ConfigError, load_config
from pixrl.stages.chaos import ENV
from pixrl.stages.faults import TransientError, is_transient
from pixrl.rewards.base import REWARDS, Reward, ScoringError


def _wrapped(inner: BaseException) -> ScoringError:
    try:
        try:
            raise inner
        except Exception as exc:
            raise ScoringError(f"scorer 'x' failed: {exc}") from exc
    except ScoringError as outer:
        return outer


@pytest.mark.parametrize("exc, transient", [
    (ConnectionResetError("peer went away"), True),
    (TimeoutError("judge took too long"), True),
    (OSError(errno.EIO, "I/O error"), True),
    (TransientError("503 from the judge server"), True),
    (_wrapped(ConnectionRefusedError("judge down")), True),  # a scorer's fault inside the RewardSet wrapper
    (RuntimeError("sqlite3.OperationalError: database is locked"), True),
    (ScoringError("scorer 'x' returned nan for sample '00000-000-00'"), False),  # NaN: deterministic
    (FileNotFoundError(errno.ENOENT, "no such checkpoint"), False),
    (PermissionError(errno.EACCES, "denied"), False),
    (CorruptCheckpoint("sha256 mismatch"), False),
    (ConfigError("unknown key"), False),
    (ValueError("bad shape"), False),
    (None, False),
])
def test_transient_classification(exc, transient):
    assert is_transient(exc) is transient


def test_retry_config_names_the_stages():
    cfg = load_config(None, ["run.retries.score.retries=5"])
    assert cfg.run.retries["score"].retries == 5 and cfg.run.retries["update"].retries == 2  # others keep defaults
    with pytest.raises(ConfigError, match="generate, decode, score, replay, update, publish"):
        load_config(None, ["run.retries.scoring.retries=1"])


class FlakyJudge(Reward):
    """Fails with a dropped connection on its first call in this process, then scores."""

    calls = 0

    def score(self, images, prompts, metadata):
        FlakyJudge.calls += 1
        if FlakyJudge.calls == 1:
            raise ConnectionResetError("judge server closed the connection")
        return {self.name: images.astype(np.float32).mean(axis=(1, 2, 3)) / 255.0}


@pytest.fixture
def flaky_reward():
    if "flaky_judge" not in REWARDS.names():
        REWARDS.register("flaky_judge")(FlakyJudge)
    FlakyJudge.calls = 0
    yield "flaky_judge"


def _task_runs(flow_run_id: str) -> dict[str, int]:
    """{task run name: run_count} over the train flow run's tasks."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id])))
        return {t.name: t.run_count for t in tasks}


def _last_flow_run_id() -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["pixrl-train"])),
                                     sort=FlowRunSort.START_TIME_DESC, limit=1)
        return str(runs[0].id)


def test_a_flaky_scorer_is_retried_and_the_run_completes(flaky_reward, tiny_checkpoint, tmp_path, prefect_harness):
    res = CliRunner().invoke(app, ["train", "-n", "1", "--run", "flaky", "reward=jpeg_compressibility",
                                   f"reward.weights.{flaky_reward}=1.0",
                                   "run.retries.score.delay_s=0.1", *tiny_overrides(tiny_checkpoint, tmp_path)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    runs = _task_runs(out["flow_run_id"])
    assert runs["score[it=0]"] == 2 and FlakyJudge.calls == 2  # failed once, retried once
    assert all(n == 1 for name, n in runs.items() if not name.startswith("score"))


def test_a_deterministic_error_fails_fast_without_retries(tiny_checkpoint, tmp_path, prefect_harness, monkeypatch):
    monkeypatch.setenv(ENV, "update@0:raise")
    res = CliRunner().invoke(app, ["train", "-n", "1", "--run", "det", "reward=jpeg_compressibility",
                                   "run.retries.update.retries=3", *tiny_overrides(tiny_checkpoint, tmp_path)])
    assert res.exit_code == 1 and "injected fault in update" in res.output
    assert _task_runs(_last_flow_run_id())["update[it=0]"] == 1  # retries were configured, none was spent


def test_an_injected_transient_fault_is_retried(tiny_checkpoint, tmp_path, prefect_harness, monkeypatch):
    monkeypatch.setenv(ENV, "publish@0:transient")
    res = CliRunner().invoke(app, ["train", "-n", "1", "--run", "tr", "reward=jpeg_compressibility",
                                   "run.retries.publish.delay_s=0", *tiny_overrides(tiny_checkpoint, tmp_path)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert _task_runs(out["flow_run_id"])["publish[it=0]"] == 2
