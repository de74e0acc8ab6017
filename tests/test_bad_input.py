"""Bad input ends in a clear error, a non-zero exit, and nothing half-written."""


import lance
import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.cli import app
from pixrl.config.loader import ConfigError, load_config
from pixrl.rewards.base import Reward, register_reward


def _run(args):
    return CliRunner().invoke(app, args)


def test_unknown_key_names_key_and_choices(tmp_path):
    res = _run(["train", f"--workdir={tmp_path / 'wd'}", "algorithm.clip_rang=0.1"])
    assert res.exit_code == 2
    assert "algorithm.clip_rang" in res.output and "clip_range" in res.output
    assert not (tmp_path / "wd").exists()


def test_config_errors_list_choices():
    with pytest.raises(ConfigError, match="available: .*shapes_flow_grpo"):
        load_config("no_such_experiment")
    with pytest.raises(ConfigError, match="unknown reward preset 'jpg'.*available"):
        load_config(None, ["reward=jpg"])
    with pytest.raises(ConfigError, match="sampling.steps"):
        load_config(None, ["sampling.steps=many"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["sampling.steps"])
    cfg = load_config(None, ["sampling.steps=7", "algorithm=flow_grpo_lora"])
    assert cfg.sampling.steps == 7 and cfg.algorithm.lora.enabled


def test_unknown_reward_lists_registered(tmp_path, tiny_checkpoint):
    res = _run(["train", *tiny_overrides(tiny_checkpoint, tmp_path / "wd"), "reward.weights={nope: 1.0}"])
    assert res.exit_code == 2 and "registered rewards" in res.output and "jpeg_compressibility" in res.output
    assert not (tmp_path / "wd").exists()


def test_missing_checkpoint_path(tmp_path):
    res = _run(["train", f"--workdir={tmp_path / 'wd'}", f"model.path={tmp_path / 'missing'}"])
    assert res.exit_code == 2 and "model_index.json" in res.output
    assert not (tmp_path / "wd").exists()


def test_a_non_square_size_for_a_square_only_family_is_refused_in_preflight(tmp_path, tiny_janus):
    res = _run(["train", f"--workdir={tmp_path / 'wd'}", "model.family=janus_pro", f"model.path={tiny_janus[0]}",
                "algorithm=token_grpo", "model.height=16", "model.width=32"])
    assert res.exit_code == 2 and "the janus_pro family makes square images" in " ".join(res.output.split())
    assert not (tmp_path / "wd").exists()


def test_empty_prompt_set(tmp_path, tiny_checkpoint):
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n")
    res = _run(["train", *tiny_overrides(tiny_checkpoint, tmp_path / "wd"), f"dataset.path={empty}"])
    assert res.exit_code == 2 and "empty" in res.output
    assert not (tmp_path / "wd").exists()


def test_unknown_training_category_names_the_available_ones(tmp_path, tiny_checkpoint):
    res = _run(["train", *tiny_overrides(tiny_checkpoint, tmp_path / "wd"), "dataset.categories=[counting,postion]"])
    msg = " ".join(res.output.split())
    assert res.exit_code == 2 and "['postion'] match no prompt" in msg and "'position'" in msg
    assert not (tmp_path / "wd").exists()
    # the default recipe trains on chosen categories; a free-form prompt file has none, and the
    # message says how to train on every prompt instead
    free = tmp_path / "free.txt"
    free.write_text("a watercolour fox\n")
    res = _run(["train", *tiny_overrides(tiny_checkpoint, tmp_path / "wd"), f"dataset.path={free}"])
    msg = " ".join(res.output.split())  # the console wraps long lines
    assert res.exit_code == 2 and "no category metadata" in msg and "dataset.categories=null" in msg
    assert not (tmp_path / "wd").exists()
    assert load_config(None, ["dataset.categories=null"]).dataset.categories is None
    res = _run(["train", *tiny_overrides(tiny_checkpoint, tmp_path / "wd"), "dataset.categories=[]"])
    assert res.exit_code == 2 and "dataset.categories is empty" in " ".join(res.output.split())
    assert not (tmp_path / "wd").exists()


@register_reward("nan_on_second_call")
class _NanOnSecondCall(Reward):
    """Scores like a real reward on its first call, returns NaN for one sample on the second."""

    calls = 0

    def score(self, images, prompts, metadata):
        type(self).calls += 1
        vals = images.reshape(len(images), -1).mean(1).astype(np.float32)
        if type(self).calls >= 2:
            vals[1] = np.nan
        return {self.name: vals}


def test_nan_score_fails_without_half_writes(tmp_path, tiny_checkpoint, prefect_harness):
    wd = tmp_path / "wd"
    res = _run(["train", "--iterations", "2", "--run", "nan", *tiny_overrides(tiny_checkpoint, wd),
                "reward.weights={nan_on_second_call: 1.0}"])
    assert res.exit_code == 1
    assert "nan_on_second_call" in res.output and "00001-000-01" in res.output  # scorer and sample named
    ds = lance.dataset(str(wd / "lance" / "nan" / "trajectories.lance"))
    it1 = ds.to_table(filter="iteration = 1")
    assert it1.num_rows == 8 and it1["reward"].null_count == 8  # score wrote nothing
    assert ds.version == 6  # it0: create, decode, score, replay; it1: generate + decode only
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    versions = client.search_model_versions("name='pixrl-policy'")
    assert [int(v.version) for v in versions] == [1]
    assert int(client.get_model_version_by_alias("pixrl-policy", "rollout").version) == 1
    run = client.search_runs([client.get_experiment_by_name("pixrl").experiment_id])[0]
    assert run.info.status == "FAILED"
    # the stores tell which stages of the failed iteration completed
    st = _run(["status", "nan", "--workdir", str(wd)])
    assert st.exit_code == 0, st.output
    rows = [ln for ln in st.output.splitlines() if ln.strip().startswith("│")]
    assert "v1" in rows[0] and rows[0].count("—") == 0
    assert "8 rows" in rows[1] and "done" in rows[1] and rows[1].count("—") == 4  # score..publish missing
