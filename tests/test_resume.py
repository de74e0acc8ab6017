"""Resume after a failure in any stage: completed stages are skipped, the MLflow run is
reattached, no Lance row is duplicated, and the final weights are bit-identical to an
uninterrupted run (CPU fp32)."""

import json

import lance
import pytest
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.cli import app
from pixrl.engines.local import LocalEngine

STAGES = ["generate", "decode", "score", "replay", "update", "publish"]


def _train(ckpt, wd, run):
    return CliRunner().invoke(app, ["train", "--iterations", "2", "--run", run, "--seed", "7",
                                    "reward=jpeg_compressibility", *tiny_overrides(ckpt, wd)])


def _final_weights(wd, run, run_id):
    return load_file(str(wd / "checkpoints" / run / run_id / "it_0001" / "trainable.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tiny_checkpoint, tmp_path_factory, prefect_harness):
    wd = tmp_path_factory.mktemp("ref")
    res = _train(tiny_checkpoint, wd, "ref")
    assert res.exit_code == 0, res.output
    run_id = json.loads(res.stdout.strip().splitlines()[-1])["run_id"]
    return _final_weights(wd, "ref", run_id)


@pytest.mark.parametrize("stage", STAGES)
def test_resume_after_exception_is_bit_identical(stage, tiny_checkpoint, tmp_path, monkeypatch, uninterrupted):
    original = getattr(LocalEngine, stage)
    calls = {"n": 0}

    def failing(self, iteration, *args, **kwargs):
        if iteration == 1 and calls["n"] == 0:
            calls["n"] += 1
            raise OSError(f"injected fault in {stage}")
        return original(self, iteration, *args, **kwargs)

    monkeypatch.setattr(LocalEngine, stage, failing)
    wd = tmp_path / "wd"
    res = _train(tiny_checkpoint, wd, "A")
    assert res.exit_code == 1 and f"injected fault in {stage}" in res.output
    res = CliRunner().invoke(app, ["resume", "A", "--workdir", str(wd)])
    assert res.exit_code == 0, res.output
    assert "(done before)" in res.output
    run_id = json.loads(res.stdout.strip().splitlines()[-1])["run_id"]
    new = _final_weights(wd, "A", run_id)
    assert all(new[k].equal(uninterrupted[k]) for k in uninterrupted), "resumed weights differ"

    ds = lance.dataset(str(wd / "lance" / "A" / "trajectories.lance"))
    t = ds.to_table(columns=["sample_id", "iteration", "advantage"])
    assert t.num_rows == 16 and len(set(zip(t["iteration"].to_pylist(), t["sample_id"].to_pylist()))) == 16
    assert t["advantage"].null_count == 0
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "FINISHED"
    assert len(client.search_runs([client.get_experiment_by_name("pixrl").experiment_id])) == 1
    for key in ("reward/reward/mean", "loss", "time/generate_s", "policy_version"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [0, 1], key
    versions = sorted(int(v.version) for v in client.search_model_versions("name='pixrl-A'"))
    assert versions == [1, 2]
    assert int(client.get_model_version_by_alias("pixrl-A", "rollout").version) == 2
