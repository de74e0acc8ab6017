"""reward.overlap: decode and score of each finished micro-batch run in a background thread
while the next generates. The prefetched columns must equal what the stages compute without
the prefetch (a resumed iteration), a scorer's failure must surface in the score stage with
nothing half-written, and the Ray engine refuses the setting."""

import json

import lance
import numpy as np
import pytest
from conftest import tiny_overrides, train_args
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from typer.testing import CliRunner

from pixrl.cli import app
from pixrl.config.loader import ConfigError, load_config
from pixrl.rewards.base import Reward, register_reward
from pixrl.stages.chaos import ENV
from pixrl.stages.overlap import Chunk, generation_order, merge_scores
from pixrl.stages.session import close_all


def _train(ckpt, wd, run, *extra):
    return CliRunner().invoke(app, train_args(ckpt, wd, run, "reward.overlap=true", *extra, seed=3))


def _table(wd, run):
    t = lance.dataset(str(wd / "lance" / run / "trajectories.lance")).to_table(
        columns=["iteration", "sample_id", "image", "reward", "rewards", "advantage"])
    return t.sort_by([("iteration", "ascending"), ("sample_id", "ascending")])


def _weights(wd, run, run_id):
    return load_file(str(wd / "checkpoints" / run / run_id / "it_0001" / "trainable.safetensors"))


@pytest.fixture(scope="module")
def overlapped(tiny_checkpoint, tmp_path_factory, prefect_harness):
    wd = tmp_path_factory.mktemp("overlap")
    res = _train(tiny_checkpoint, wd, "ov")
    assert res.exit_code == 0, res.output
    return wd, json.loads(res.stdout.strip().splitlines()[-1])["run_id"]


def test_the_prefetch_is_used_and_logged(overlapped):
    wd, run_id = overlapped
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    for key in ("overlap/decode_wait_s", "overlap/score_wait_s", "decode_compute_s", "score_compute_s"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [0, 1], key
    t = _table(wd, "ov")
    assert t.num_rows == 16 and t["reward"].null_count == 0 and t["image"].null_count == 0


def test_an_iteration_decoded_and_scored_without_the_prefetch_is_bit_identical(
        overlapped, tiny_checkpoint, tmp_path, monkeypatch):
    """decode@1 fails before its commit; the resume runs in a fresh stage layer (as a new process
    would), so iteration 1's decode and score find nothing prefetched and compute per micro-batch
    from the store — the same bytes, rewards and final weights as the prefetched run."""
    wd_ref, run_id_ref = overlapped
    wd = tmp_path / "wd"
    monkeypatch.setenv(ENV, "decode@1:raise")
    res = _train(tiny_checkpoint, wd, "ov")
    assert res.exit_code == 1 and "injected fault in decode" in res.output
    monkeypatch.delenv(ENV)
    close_all()  # what a new process starts with: no prefetched chunks
    res = CliRunner().invoke(app, ["resume", "ov", "--workdir", str(wd)])
    assert res.exit_code == 0, res.output
    run_id = json.loads(res.stdout.strip().splitlines()[-1])["run_id"]
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    assert [m.step for m in client.get_metric_history(run_id, "overlap/decode_wait_s")] == [0]  # 1 was not prefetched
    a, b = _table(wd_ref, "ov"), _table(wd, "ov")
    for col in ("sample_id", "image", "reward", "rewards", "advantage"):
        assert a[col].equals(b[col]), col
    ref, new = _weights(wd_ref, "ov", run_id_ref), _weights(wd, "ov", run_id)
    assert all(new[k].equal(ref[k]) for k in ref)


@register_reward("nan_on_tenth_image")
class _NanOnTenthImage(Reward):
    """A real-looking score per image; NaN for the tenth image it ever scores (iteration 1's
    second sample), however the images are batched."""

    seen = 0

    def score(self, images, prompts, metadata):
        vals = images.reshape(len(images), -1).mean(1).astype(np.float32)
        for i in range(len(images)):
            if type(self).seen + i == 9:
                vals[i] = np.nan
        type(self).seen += len(images)
        return {self.name: vals}


def test_a_background_scorer_failure_fails_the_score_stage_with_nothing_half_written(
        tiny_checkpoint, tmp_path, prefect_harness):
    _NanOnTenthImage.seen = 0
    wd = tmp_path / "wd"
    res = CliRunner().invoke(app, ["train", "--iterations", "2", "--run", "nan", "reward.overlap=true",
                                   *tiny_overrides(tiny_checkpoint, wd), "reward.weights={nan_on_tenth_image: 1.0}"])
    assert res.exit_code == 1
    assert "nan_on_tenth_image" in res.output and "00001-000-01" in res.output  # scorer and sample named
    ds = lance.dataset(str(wd / "lance" / "nan" / "trajectories.lance"))
    it1 = ds.to_table(filter="iteration = 1")
    assert it1.num_rows == 8 and it1["image"].null_count == 0  # decode committed the prefetched bytes
    assert it1["reward"].null_count == 8  # score wrote nothing
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    assert [int(v.version) for v in client.search_model_versions("name='pixrl-policy'")] == [1]


def test_the_ray_engine_refuses_overlap():
    with pytest.raises(ConfigError, match="reward.overlap=false"):
        load_config(None, ["reward.overlap=true", "run.engine=ray"])


def test_chunks_follow_generation_order_and_scores_return_to_row_order():
    groups, index = np.array([1, 0, 1, 0]), np.array([0, 1, 1, 0])  # stored order ≠ generation order
    parts = generation_order(groups, index, 2)
    assert [p.tolist() for p in parts] == [[3, 1], [0, 2]]
    chunks = [Chunk(["a", "b"], [], None, 0.0, {"reward": np.array([1.0, 2.0])}),
              Chunk(["c", "d"], [], None, 0.0, {"reward": np.array([3.0, 4.0])})]
    assert merge_scores(chunks, parts, 4)["reward"].tolist() == [3.0, 2.0, 4.0, 1.0]
    boom = Chunk(["a"], [], None, 0.0, ValueError("scorer x failed"))
    with pytest.raises(ValueError, match="scorer x failed"):
        merge_scores([boom], [np.array([0])], 1)
