"""Past iterations as inputs: `pixrl replay RUN --iteration N` recomputes the update bit for bit;
`--from-stage S --into NEW` forks a new run with lineage (parent run, iteration, Lance version)."""

import json

import lance
import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.artifacts.tracking import Tracker
from pixrl.cli import app
from pixrl.config.schema import ExperimentConfig
from pixrl.stages.lineage import replay_update
from pixrl.run import run_spec


def _ok(args):
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def parent(tiny_checkpoint, tmp_path_factory, prefect_harness):
    wd = tmp_path_factory.mktemp("lineage")
    out = _ok(["train", "-n", "2", "--run", "P", "--seed", "3", "reward=jpeg_compressibility",
               *tiny_overrides(tiny_checkpoint, wd)])
    return wd, out["run_id"]


def _weights(wd, run, run_id, it):
    return load_file(str(wd / "checkpoints" / run / run_id / f"it_{it:04d}" / "trainable.safetensors"))


def _rows(wd, run, it, cols):
    t = lance.dataset(str(wd / "lance" / run / "trajectories.lance")).to_table(columns=["sample_id", *cols],
                                                                               filter=f"iteration = {it}")
    return t.sort_by("sample_id")


@pytest.mark.parametrize("iteration", [0, 1])
def test_replayed_update_equals_the_recorded_checkpoint(parent, iteration):
    wd, _ = parent
    rep = _ok(["replay", "P", "--iteration", str(iteration), "--workdir", str(wd)])
    assert rep["equal"] is True and rep["tensors"] > 0 and rep["differing"] == []


def test_replay_reports_a_difference(parent):
    """The comparison is real: the same replay under another learning rate does not match."""
    wd, run_id = parent
    tracker = Tracker(f"sqlite:///{wd / 'mlflow.db'}")
    cfg = ExperimentConfig.model_validate(tracker.read_config(run_id))
    cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"lr": cfg.algorithm.lr * 10})})
    rep = replay_update(run_spec(cfg, wd, run_id), 1)
    assert not rep.equal and rep.differing and rep.max_abs_diff > 0


def test_fork_from_score_reproduces_the_parent_and_records_lineage(parent):
    wd, parent_id = parent
    out = _ok(["replay", "P", "--iteration", "1", "--from-stage", "score", "--into", "F", "--workdir", str(wd)])
    fid = out["run_id"]
    want, got = _weights(wd, "P", parent_id, 1), _weights(wd, "F", fid, 1)
    assert all(got[k].equal(want[k]) for k in want)  # same inputs, same update: bit-identical
    p_rows, f_rows = _rows(wd, "P", 1, ["image", "reward", "advantage"]), _rows(wd, "F", 1, ["image", "reward", "advantage"])
    assert f_rows["image"].equals(p_rows["image"])  # decode was reused, not recomputed
    assert f_rows["reward"].equals(p_rows["reward"]) and f_rows["advantage"].equals(p_rows["advantage"])
    assert lance.dataset(str(wd / "lance" / "F" / "trajectories.lance")).count_rows(filter="iteration = 0") == 0

    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    tags = client.get_run(fid).data.tags
    assert tags["pixrl.parent_run_id"] == parent_id and tags["pixrl.parent_run_name"] == "P"
    assert tags["pixrl.fork_iteration"] == "1" and tags["pixrl.fork_stage"] == "score"
    assert int(tags["pixrl.parent_table_version"]) >= 1 and tags["pixrl.parent_table_uri"].endswith("P/trajectories.lance")
    assert [m.step for m in client.get_metric_history(fid, "loss")] == [1]
    assert [m.step for m in client.get_metric_history(fid, "reward/reward/mean")] == [1]  # score ran in the fork
    assert client.get_metric_history(fid, "time/decode_s") == []  # decode did not
    (fork_version,) = client.search_model_versions(f"name='pixrl-policy' and run_id='{fid}'")
    assert fork_version.tags["iteration"] == "1"  # parent and fork share the experiment's model
    assert client.get_model_version_by_alias("pixrl-policy", "rollout").version == fork_version.version


def test_fork_from_generate_with_an_override_branches_from_the_right_policy(parent):
    wd, parent_id = parent
    out = _ok(["replay", "P", "--iteration", "1", "--from-stage", "generate", "--into", "G", "--workdir", str(wd),
               "algorithm.lr=1e-2"])
    # iteration 1 rolled out with the parent's policy after iteration 0 and the same seeds: same latents
    p_rows, g_rows = _rows(wd, "P", 1, ["final_latent", "policy_version"]), _rows(wd, "G", 1, ["final_latent"])
    np.testing.assert_array_equal(g_rows["final_latent"].combine_chunks().to_numpy_ndarray(),
                                  p_rows["final_latent"].combine_chunks().to_numpy_ndarray())
    want, got = _weights(wd, "P", parent_id, 1), _weights(wd, "G", out["run_id"], 1)
    assert any(not got[k].equal(want[k]) for k in want)  # but its update used lr 1e-2
    cfg = Tracker(f"sqlite:///{wd / 'mlflow.db'}").read_config(out["run_id"])
    assert cfg["algorithm"]["lr"] == 1e-2 and cfg["run"]["name"] == "G"


def test_fork_refuses_an_existing_name_and_bad_stages(parent):
    wd, _ = parent
    res = CliRunner().invoke(app, ["replay", "P", "--iteration", "1", "--from-stage", "score", "--into", "P",
                                   "--workdir", str(wd)])
    assert res.exit_code == 2 and "already exists" in res.output
    res = CliRunner().invoke(app, ["replay", "P", "--iteration", "1", "--from-stage", "publish", "--into", "Z",
                                   "--workdir", str(wd)])
    assert res.exit_code == 2 and "generate, decode, score, replay, update" in res.output
    res = CliRunner().invoke(app, ["replay", "P", "--iteration", "5", "--workdir", str(wd)])
    assert res.exit_code == 2 and "no checkpoint for iteration 5" in res.output
