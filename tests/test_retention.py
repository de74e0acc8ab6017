"""Checkpoint retention (`run.keep_checkpoints`): a real run prunes old checkpoints locally and in
the MLflow registry, keeps evaluated and aliased versions loadable, and refuses pruned ones with
a message (real Prefect, MLflow, Lance, a tiny SD3 model)."""

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.artifacts.tracking import PRUNED_TAG, PrunedCheckpoint, Tracker
from pixrl.cli import app


def test_keep_checkpoints_prunes_old_iterations_but_not_evaluated_or_aliased_ones(tiny_checkpoint, tmp_path,
                                                                                 prefect_harness):
    res = CliRunner().invoke(app, ["train", "-n", "4", "--run", "kept", "reward=jpeg_compressibility",
                                   *tiny_overrides(tiny_checkpoint, tmp_path, **{
                                       "run.keep_checkpoints": 1, "run.eval_every": 2, "run.eval_per_category": 1})])
    assert res.exit_code == 0, res.output
    run_id = json.loads(res.stdout.strip().splitlines()[-1])["run_id"]
    local = tmp_path / "checkpoints" / "kept" / run_id
    assert sorted(p.name for p in local.iterdir()) == ["it_0003"]  # the newest resumes the run
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    versions = {int(v.tags["iteration"]): v for v in client.search_model_versions(f"run_id='{run_id}'")}
    assert sorted(versions) == [0, 1, 2, 3]  # every version stays registered, with its lineage tags

    def has_weights(v) -> bool:
        return (Path(v.source.removeprefix("file://")) / "trainable.safetensors").is_file()

    for it in (1, 3):  # evaluated after iterations 2 and 4: the held-out curve's points stay loadable
        assert "heldout_accuracy" in versions[it].tags and has_weights(versions[it])
        assert PRUNED_TAG not in versions[it].tags
    for it in (0, 2):
        assert versions[it].tags[PRUNED_TAG] == "keep_checkpoints=1" and not has_weights(versions[it])
    pruned_metric = client.get_metric_history(run_id, "checkpoints_pruned")
    assert sum(m.value for m in pruned_metric) == 3  # local dirs of iterations 0, 1 and 2

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(PrunedCheckpoint, match="was pruned by keep_checkpoints=1"):
        tracker.download(tracker.version("pixrl-policy", int(versions[2].version)), tmp_path / "dl")
    res = CliRunner().invoke(app, ["replay", "kept", "--iteration", "1", "--from-stage", "update", "--into", "f",
                                   "--workdir", str(tmp_path)])
    assert res.exit_code == 2 and "cannot fork at iteration 1" in res.output and "pruned" in res.output
    res = CliRunner().invoke(app, ["replay", "kept", "--iteration", "2", "--workdir", str(tmp_path)])
    assert res.exit_code == 2 and "keep_checkpoints=1" in res.output
    res = CliRunner().invoke(app, ["eval", "--run", "kept", "--workdir", str(tmp_path), "--json",
                                   "--per-category", "1", "--steps", "2"])
    assert res.exit_code == 0, res.output  # the run's newest version still loads from the registry
