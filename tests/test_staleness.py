"""run.staleness: iteration i samples with the policy of iteration i − N, the update recomputes
the old log-probs under its own starting weights (engines/proximal.py), and resume, forks and
`pixrl replay` follow the same schedule bit for bit (stages/schedule.py)."""

from __future__ import annotations

import json

import lance
import pyarrow.compute as pc
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import fault_then_resume, train_args
from pixrl.cli import app
from pixrl.config.loader import ConfigError, load_config
from pixrl.stages.schedule import PolicySchedule


def _p(v: int) -> dict:
    return {"model_name": "m", "version": v}


def test_the_schedule_samples_n_iterations_back():
    on = PolicySchedule(0, 0, _p(0))
    assert on.sampling(0) == _p(0)
    on.published(0, _p(1))
    assert on.sampling(1) == _p(1)  # on-policy: the update's own

    s = PolicySchedule(1, 0, _p(0))
    assert s.sampling(0) == _p(0) and s.sampling(1) == _p(0)  # the first N iterations: the base weights
    s.published(0, _p(1))
    s.published(1, _p(2))
    assert s.sampling(2) == _p(1) and s.sampling(3) == _p(2)

    two = PolicySchedule(2, 5, _p(5), {"3": _p(3), "4": _p(4)})  # a fork at 5 carries 3 and 4 (JSON keys)
    assert [two.sampling(i)["version"] for i in (5, 6)] == [3, 4]
    two.published(5, _p(6))
    assert two.sampling(7) == _p(5)
    with pytest.raises(RuntimeError, match="a fork must carry"):
        PolicySchedule(1, 5, _p(5)).sampling(5)


def test_a_retention_that_would_delete_the_sampling_checkpoint_is_refused():
    with pytest.raises(ConfigError, match=r"run.retention.keep_full >= 3"):
        load_config(None, ["run.staleness=2", "run.retention.keep_full=2"])
    assert load_config(None, ["run.staleness=2"]).run.staleness == 2  # keep_full 3 by default
    with pytest.raises(ConfigError, match="staleness"):
        load_config(None, ["run.staleness=5"])


def _history(wd, out, key):
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    return [m.value for m in sorted(client.get_metric_history(out["run_id"], key), key=lambda m: m.step)]


def _run(ckpt, wd, run, *extra):
    return CliRunner().invoke(app, train_args(ckpt, wd, run, "run.staleness=1", "algorithm.optimizer_steps_per_iteration=2",
                                              "algorithm.lr=1e-3", *extra, iterations=3))


def _final(wd, run, it=2):
    return load_file(str(sorted((wd / "checkpoints" / run).glob(f"*/it_{it:04d}"))[0] / "trainable.safetensors"))


@pytest.fixture(scope="module")
def one_step_off(tiny_checkpoint, tmp_path_factory, prefect_harness):
    wd = tmp_path_factory.mktemp("stale")
    res = _run(tiny_checkpoint, wd, "ref")
    assert res.exit_code == 0, res.output + repr(res.exception)
    return wd, json.loads(res.stdout.strip().splitlines()[-1])


def test_one_step_off_samples_the_previous_policy_and_trains_against_its_own_start(one_step_off, tiny_checkpoint):
    wd, out = one_step_off
    t = lance.dataset(out["table_uri"]).to_table()
    versions = {it: set(t.filter(pc.equal(t["iteration"], it))["policy_version"].to_pylist()) for it in range(3)}
    assert versions == {0: {0}, 1: {0}, 2: {1}}  # iteration i samples with the weights after i − 1 updates
    drift = _history(wd, out, "off_policy/log_ratio_abs_mean")
    assert drift[0] == 0.0 and drift[1] > 0 and drift[2] > 0  # iteration 0 sampled with its own start
    assert _history(wd, out, "off_policy/ratio_max")[1] != 1.0
    # the first optimizer step's ratio is exactly 1: the old log-probs are the update's start's
    # (the table keeps the sampler's: the fork test regenerates them bit for bit)
    assert _history(wd, out, "onpolicy_ratio_dev") == [0.0, 0.0, 0.0]


def test_without_the_recompute_the_first_ratio_would_not_be_one(one_step_off, tiny_checkpoint, tmp_path, monkeypatch):
    """The control: the same run with the proximal pass skipped starts iteration 1's update off 1."""
    import pixrl.engines.update as update

    monkeypatch.setattr(update, "proximal_batch", lambda algo, batch, *a, **k: (batch, {}))
    res = _run(tiny_checkpoint, tmp_path, "control")
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    dev = _history(tmp_path, out, "onpolicy_ratio_dev")
    assert dev[0] == 0.0 and dev[1] > 0 and dev[2] > 0


def test_the_behaviour_weight_is_the_truncated_ratio_of_proximal_to_behaviour():
    import numpy as np

    from pixrl.engines.proximal import behaviour_weights

    behaviour = np.log(np.array([[0.5, 0.2], [0.4, 0.1]], dtype=np.float32))
    proximal = np.log(np.array([[0.6, 0.1], [0.4, 0.3]], dtype=np.float32))
    w = behaviour_weights(behaviour, proximal, 2.0)
    assert w.dtype == np.float32 and np.allclose(w, [[1.2, 0.5], [1.0, 2.0]], atol=1e-6)  # 3.0 truncated to 2
    with pytest.raises(ConfigError, match="set run.staleness >= 1"):
        load_config(None, ["run.staleness_weight_cap=2.0"])
    with pytest.raises(ConfigError, match="staleness_weight_cap"):
        load_config(None, ["run.staleness=1", "run.staleness_weight_cap=1.0"])  # a cap below 1 would down-weight all


def test_a_weighted_one_step_off_update_truncates_and_replays(one_step_off, tiny_checkpoint, tmp_path):
    """With run.staleness_weight_cap each transition's loss carries min(π_prox/π_behav, C): 1 at
    iteration 0 (sampled with its update's own start), off 1 after — here C just above 1 truncates
    some — and the trained weights differ from the unweighted run's; replay recomputes it exactly."""
    ref_wd, _ = one_step_off
    res = _run(tiny_checkpoint, tmp_path, "weighted", "run.staleness_weight_cap=1.0001")
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    mean, capped = _history(tmp_path, out, "off_policy/weight_mean"), _history(tmp_path, out, "off_policy/weight_capped_frac")
    assert mean[0] == 1.0 and capped[0] == 0.0
    assert mean[1] != 1.0 and mean[2] != 1.0 and max(capped[1:]) > 0
    assert _history(tmp_path, out, "onpolicy_ratio_dev") == [0.0, 0.0, 0.0]  # the ratio is still to the start
    a, b = _final(tmp_path, "weighted", 0), _final(ref_wd, "ref", 0)
    assert all(torch.equal(a[k], b[k]) for k in b)  # iteration 0: every weight 1, the same update
    a, b = _final(tmp_path, "weighted"), _final(ref_wd, "ref")
    assert any(not torch.equal(a[k], b[k]) for k in b), "the behaviour weight changed no update"
    rep = CliRunner().invoke(app, ["replay", "weighted", "--iteration", "2", "--workdir", str(tmp_path)])
    assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output


def test_an_algorithm_without_a_behaviour_ratio_refuses_the_weight(tiny_checkpoint, tmp_path):
    from pixrl.stages.preflight import PreflightError, preflight

    cfg = load_config(None, [f"model.path={tiny_checkpoint}", f"run.workdir={tmp_path}", "algorithm=diffusion_nft",
                             "run.staleness=1", "run.staleness_weight_cap=2.0"])
    with pytest.raises(PreflightError, match="takes no behaviour weight.*flow_grpo"):
        preflight(cfg)


def test_a_fault_in_update_then_resume_equals_the_uninterrupted_run(one_step_off, tiny_checkpoint, tmp_path,
                                                                    monkeypatch):
    ref_wd, out = one_step_off
    fault_then_resume(monkeypatch, lambda: _run(tiny_checkpoint, tmp_path, "A"), tmp_path, "A", "update@2:raise")
    a, b = _final(tmp_path, "A"), _final(ref_wd, "ref")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b), "resumed weights differ"
    cols = ["sample_id", "policy_version", "log_probs", "latents", "reward", "advantage"]
    got = lance.dataset(str(tmp_path / "lance" / "A" / "trajectories.lance")).to_table(columns=cols).sort_by("sample_id")
    want = lance.dataset(out["table_uri"]).to_table(columns=cols).sort_by("sample_id")
    assert got.equals(want)


def test_replay_recomputes_an_off_policy_update_bit_for_bit(one_step_off):
    wd, _ = one_step_off
    res = CliRunner().invoke(app, ["replay", "ref", "--iteration", "2", "--workdir", str(wd)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert json.loads(res.stdout.strip().splitlines()[-1])["equal"] is True


def test_a_fork_samples_with_the_parents_earlier_policy(one_step_off, tmp_path):
    """A fork at iteration 2 that regenerates it samples with the parent's policy after 1 update,
    as the parent did: its rows of iteration 2 equal the parent's."""
    wd, out = one_step_off
    res = CliRunner().invoke(app, ["replay", "ref", "--iteration", "2", "--from-stage", "generate", "--into", "forked",
                                   "--workdir", str(wd)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    cols = ["sample_id", "policy_version", "log_probs", "latents", "final_latent"]
    parent = lance.dataset(out["table_uri"]).to_table(columns=cols + ["iteration"])
    parent = parent.filter(pc.equal(parent["iteration"], 2)).select(cols).sort_by("sample_id")
    child = lance.dataset(str(wd / "lance" / "forked" / "trajectories.lance")).to_table(columns=cols + ["iteration"])
    child = child.filter(pc.equal(child["iteration"], 2)).select(cols).sort_by("sample_id")
    assert child.num_rows == parent.num_rows and child.equals(parent)
    a, b = _final(wd, "forked"), _final(wd, "ref")
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_token_family_recomputes_image_and_text_log_probs(tiny_janus, tmp_path, prefect_harness):
    """Token GRPO with a chain of thought, one step off: iteration 1 sampled with the base weights
    trains against the weights after iteration 0 — both the image and the text tokens' old
    log-probs recomputed, so its first ratio is exactly 1."""
    from conftest import tiny_overrides

    path, _ = tiny_janus
    res = CliRunner().invoke(app, ["train", "--iterations", "2", "--run", "tok", "--seed", "4",
                                   "model.family=janus_pro", "algorithm=token_grpo", "algorithm.lr=1e-2",
                                   "reward=jpeg_compressibility", "sampling.guidance_scale=5", "sampling.cot_tokens=6",
                                   'sampling.cot_template="Think: {prompt}"', "run.staleness=1",
                                   *tiny_overrides(path, tmp_path)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert _history(tmp_path, out, "onpolicy_ratio_dev") == [0.0, 0.0]
    drift = _history(tmp_path, out, "off_policy/log_ratio_abs_mean")
    assert drift[0] == 0.0 and drift[1] > 0
