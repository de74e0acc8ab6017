"""GARDO (algorithms/gardo.py): its advantages, KL gate, gate controller and reference resets
against GARDO's formulas (tinnerhrhe/GARDO scripts/train_sd3_grpo_gardo.py, stat_tracking.py),
the diversity reward on a real (tiny) DINOv2, and the real flow with a fault and a resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import fault_then_resume, tiny_overrides
from pixrl.algorithms.flow_grpo import Transition
from pixrl.algorithms.flow_sde import StepOut
from pixrl.algorithms.gardo import (GARDO, GateController, descending_ranks, gardo_advantages, gate,
                                    uncertainty)
from pixrl.config.loader import ConfigError, load_config
from pixrl.rewards.base import ScoringError
from pixrl.rewards.diversity import Diversity, nearest_distances


def _gardo(**keys):
    cfg = load_config(None, ["algorithm=gardo", "algorithm.auxiliary=[aesthetic]",
                             *[f"algorithm.{k}={v}" for k, v in keys.items()]])
    return GARDO(cfg.algorithm)


# --- advantages -----------------------------------------------------------------------------------
def _tracker_gardo(rewards, prompts, feats):
    """GARDO's per-prompt 'gardo' advantages written out sample by sample: features normalised,
    each sample's distance to its prompt's nearest other sample, that distance over the prompt's
    mean distance for samples at or above the prompt's mean reward (1 below), times r − mean."""
    f = feats / np.linalg.norm(feats, axis=1, keepdims=True)
    out = np.zeros(len(rewards))
    for p in set(prompts):
        idx = [i for i, q in enumerate(prompts) if q == p]
        mean = np.mean([rewards[i] for i in idx])
        dmin = {i: min(1 - np.clip(f[i] @ f[j], -1, 1) for j in idx if j != i) for i in idx}
        mean_d = np.mean(list(dmin.values()))
        for i in idx:
            w = 1.0 if rewards[i] - mean < 0 else dmin[i] / mean_d
            out[i] = (rewards[i] - mean) * w
    return out


def test_advantages_are_gardos_diversity_shaped_centred_rewards():
    rng = np.random.default_rng(0)
    prompts = [f"p{i % 3}" for i in range(18)]
    rewards = rng.normal(size=18)
    feats = rng.normal(size=(18, 8))
    groups = np.array([int(p[1]) for p in prompts])
    d = nearest_distances(feats, prompts)
    got = gardo_advantages(rewards, groups, d, clip=100.0)
    assert np.allclose(got.advantages, _tracker_gardo(rewards, prompts, feats), atol=1e-6)
    plain = gardo_advantages(rewards, groups, None, clip=100.0).advantages  # no diversity: r − mean, no std
    assert np.allclose(plain, rewards - np.array([rewards[groups == g].mean() for g in groups]), atol=1e-6)
    below = plain < 0
    assert np.allclose(got.advantages[below], plain[below], atol=1e-6)  # below the mean: weight 1
    std = gardo_advantages(rewards, groups, d, divide_by_std=True, clip=100.0).advantages
    assert np.allclose(std, got.advantages / (np.std(rewards) + 1e-4), atol=1e-5)
    assert np.abs(gardo_advantages(rewards * 100, groups, d).advantages).max() == 5.0  # clipped to ±5


def test_identical_images_keep_weight_one_and_a_lone_sample_is_refused():
    rewards = np.array([1.0, 2.0, 3.0])
    same = nearest_distances(np.ones((3, 4)), ["a"] * 3)
    assert np.allclose(same, 0)
    adv = gardo_advantages(rewards, np.zeros(3), same).advantages
    assert np.allclose(adv, [-1, 0, 1])
    with pytest.raises(ScoringError, match="alone in its group"):
        nearest_distances(np.eye(3), ["a", "a", "b"])


# --- the KL gate and its controller ------------------------------------------------------------------
def test_uncertainty_ranks_the_proxy_against_the_auxiliary_scores():
    assert descending_ranks(np.array([0.2, 0.9, 0.5, 0.5])).tolist() == [4, 1, 2, 3]  # ties: sample order
    proxy = np.array([4.0, 3.0, 2.0, 1.0, 0.0])
    aux = [np.array([0.0, 1.0, 2.0, 3.0, 4.0]), np.array([4.0, 3.0, 2.0, 1.0, 0.0])]
    u = uncertainty(proxy, aux)  # proxy ranks 1..5; aux mean ranks all 3
    assert u.tolist() == [-2, -1, 0, 1, 2]
    # the top fraction of the non-negative u's: percentile 90 of [0, 1, 2] is 1.8 → only u = 2
    assert gate(u, 0.1).tolist() == [False, False, False, False, True]
    assert gate(u, 0.5).tolist() == [False, False, False, False, True]  # median 1: u > 1, strictly
    assert gate(u, 0.7).tolist() == [False, False, False, True, True]  # percentile 30: 0.6
    assert not gate(np.array([-1.0, -2.0]), 0.1).any()


def test_the_controller_follows_gardos_risk_compensator():
    ctl = GateController(0.1, 0.02, 0.2, 0.1, 3)
    risks = [1.0, 2.0, 1.5, 0.5, 3.0, 3.0, 4.0, 4.0, 4.0, 4.0]
    want, beta, buf = [], 0.1, []
    for r in risks:  # GARDO's rule, written out
        if buf:
            beta = beta * 1.1 if r > max(buf) else beta * 0.9 if r < min(buf) else beta
        beta = min(max(beta, 0.02), 0.2)
        buf = (buf + [r])[-3:]
        want.append(beta)
    got = [ctl.update(np.array([r, -5.0])) for r in risks]  # negative u's do not count
    assert np.allclose(got, want) and ctl.fraction == pytest.approx(want[-1])


# --- the loss and the reference ---------------------------------------------------------------------
class _Steps:
    """The policy's and the reference's step on a transition (given means), as ReplayPolicy gives them."""

    def __init__(self, ref_mean):
        self.ref_mean = ref_mean

    @staticmethod
    def tensor(a):
        return torch.as_tensor(np.asarray(a))

    def step(self, x, x_next, k, reference=False):
        assert reference
        return StepOut(x_next, torch.zeros(len(x)), self.ref_mean, torch.ones(len(x)), torch.ones(len(x)))


def test_the_kl_binds_only_the_gated_samples():
    algo = _gardo(beta=0.5)
    algo._gated = {"a": True, "b": False, "c": True}
    mean = torch.zeros(3, 2, 2, 2, requires_grad=True)
    ref_mean = torch.stack([torch.full((2, 2, 2), v) for v in (1.0, 5.0, 3.0)])
    new = StepOut(mean, torch.zeros(3, requires_grad=True), mean, torch.ones(3), torch.full((3,), 2.0))
    batch = {"sample_id": ["a", "b", "c"], "log_probs": np.zeros((3, 1), np.float32)}
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, metrics = algo.step_loss(Transition(0, 0, mean, mean, new), batch, adv, _Steps(ref_mean))
    # gated rows a and c: mean of (0 − 1)²/(2·4) and (0 − 3)²/(2·4); b's 25/8 left out
    assert metrics["kl"].item() == pytest.approx((1 / 8 + 9 / 8) / 2)
    loss.backward()
    assert mean.grad[1].abs().max() == 0 and mean.grad[0].abs().max() > 0
    algo._gated = {}
    _, metrics = algo.step_loss(Transition(0, 0, mean, mean, new), batch, adv, _Steps(ref_mean))
    assert metrics["kl"].item() == 0


def test_the_reference_resets_on_a_large_kl_and_after_reset_every_updates():
    algo = _gardo(kl_threshold=1e-3, reset_every=3)
    w = lambda v: {"x": torch.full((2,), float(v))}  # noqa: E731
    assert algo.reference_weights() is None  # the base model's, until the first reset
    resets = []
    for i, kl in enumerate([1e-4, 2e-3, 0.0, 0.0, 0.0, 0.0, 0.0]):
        algo.after_optimizer_step({"kl": kl})
        resets.append(algo.end_of_update(w(i), 1)["gardo/reference_reset"])
        state = algo.state()
        algo.load_state(state)  # each update in a new process: the state carries it
    # update 1's KL passes 1e-3 → the weights after it; then 3 updates pass: reset after update 5
    assert resets == [0, 1, 0, 0, 0, 1, 0]
    assert algo.reference_weights()["x"].tolist() == [5.0, 5.0]
    off = _gardo(beta=0)
    off.after_optimizer_step({"kl": 1.0})
    assert off.end_of_update(w(0), 1)["gardo/reference_reset"] == 0 and not off.needs_reference


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="auxiliary"):
        GARDO(load_config(None, ["algorithm=gardo"]).algorithm)
    with pytest.raises(ConfigError, match="gate_min"):
        _gardo(gate_start=0.5)


def test_preflight_names_a_score_no_reward_stores(tiny_checkpoint, tmp_path):
    from pixrl.stages.preflight import PreflightError, preflight

    cfg = load_config("shapes_gardo", [*tiny_overrides(tiny_checkpoint, tmp_path), "algorithm.auxiliary=[aesthetic]"])
    with pytest.raises(PreflightError, match="'aesthetic' is not a score these rewards store"):
        preflight(cfg)
    cfg = load_config("shapes_gardo", [*tiny_overrides(tiny_checkpoint, tmp_path), "reward.aggregate=advantage"])
    with pytest.raises(PreflightError, match="set reward.aggregate=reward"):
        preflight(cfg)


# --- the diversity reward on a real DINOv2 ---------------------------------------------------------
def test_diversity_is_each_images_distance_to_its_groups_nearest(tiny_dino):
    from transformers import AutoImageProcessor, Dinov2Model

    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    images[1] = images[0]  # a copy: distance 0 to each other
    reward = Diversity(path=str(tiny_dino), batch_size=4)
    reward.ensure_setup("cpu")
    groups = ["g0", "g0", "g0", "g1", "g1", "g1"]
    got = reward.score(images, ["p"] * 6, [{}] * 6, groups=groups)["diversity"]
    model, proc = Dinov2Model.from_pretrained(str(tiny_dino)), AutoImageProcessor.from_pretrained(str(tiny_dino))
    with torch.no_grad():
        cls = model(**proc(images=list(images), return_tensors="pt")).last_hidden_state[:, 0]  # CLS, normed
    f = torch.nn.functional.normalize(cls, dim=-1).numpy()
    for i in range(6):
        others = [j for j in range(6) if groups[j] == groups[i] and j != i]
        assert got[i] == pytest.approx(min(1 - f[i] @ f[j] for j in others), abs=1e-5)
    assert got[0] == got[1] == pytest.approx(0, abs=1e-6) and got[2] > 0


def test_diversity_refuses_a_path_without_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="reward.options.diversity.path"):
        Diversity(path=str(tmp_path))


# --- the real flow -----------------------------------------------------------------------------------
def _run(ckpt, wd, run, dino, *extra):
    from typer.testing import CliRunner

    from pixrl.cli import app

    args = tiny_overrides(ckpt, wd, **{"sampling.window_size": "null", "sampling.window_range": "null"})
    return CliRunner().invoke(app, [
        "train", "--iterations", "3", "--run", run, "--config", "shapes_gardo", *args,
        "reward.weights={jpeg_compressibility: 1.0, brisque: 0.0, shapes: 0.0, diversity: 0.0}",
        f"reward.options.diversity.path={dino}", "algorithm.proxy=jpeg_compressibility",
        "algorithm.auxiliary=[brisque, shapes]", "algorithm.diversity=diversity", "algorithm.gate_start=0.5",
        "algorithm.gate_max=0.5", "algorithm.kl_threshold=1e-12", "algorithm.optimizer_steps_per_iteration=2",
        "algorithm.lr=1e-3", *extra])


def test_three_iterations_reset_the_reference_and_resume_bit_identical(tiny_checkpoint, tiny_dino, tmp_path,
                                                                       monkeypatch, prefect_harness):
    import lance
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    from pixrl.artifacts.checkpoints import load_optimizer_state
    from pixrl.engines.policy import ALGORITHM_STATE

    ref = tmp_path / "ref"
    res = _run(tiny_checkpoint, ref, "ref", tiny_dino)
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    t = lance.dataset(str(ref / "lance" / "ref" / "trajectories.lance")).to_table().sort_by("sample_id")
    assert t.num_rows == 24 and t["advantage"].null_count == 0
    names = {c["name"] for row in t["rewards"].to_pylist() for c in row}
    assert {"jpeg_compressibility", "brisque", "shapes", "diversity"} <= names
    client = MlflowClient(f"sqlite:///{ref / 'mlflow.db'}")
    hist = lambda k: [m.value for m in sorted(client.get_metric_history(out["run_id"], k), key=lambda m: m.step)]  # noqa: E731
    fractions = hist("gardo/gate_fraction")  # starts at gate_start, then follows the risk
    assert fractions[0] == 0.5 and all(0.02 <= f <= 0.5 for f in fractions) and all(g >= 1 for g in hist("gardo/gated"))
    assert hist("onpolicy_ratio_dev") == [0, 0, 0]  # rollout → replay, bit for bit
    assert hist("kl")[1] > 0 and hist("gardo/reference_reset")[:2] == [1.0, 1.0]
    cks = sorted((ref / "checkpoints" / "ref").glob("*/it_000*"))
    state = load_optimizer_state(cks[0])[ALGORITHM_STATE]
    w0 = load_file(str(cks[0] / "trainable.safetensors"))
    assert state["last_reset"] == state["updates"] == 1
    assert all(torch.equal(state["reference"][k], w0[k]) for k in w0)  # the reference: the weights after it 0

    wd = tmp_path / "A"
    fault_then_resume(monkeypatch, lambda: _run(tiny_checkpoint, wd, "A", tiny_dino), wd, "A", "update@2:raise")
    final = lambda d, r: load_file(str(sorted((d / "checkpoints" / r).glob("*/it_0002"))[0] / "trainable.safetensors"))  # noqa: E731
    a, b = final(wd, "A"), final(ref, "ref")
    assert all(torch.equal(a[k], b[k]) for k in b), "resumed weights differ"
    resumed = lance.dataset(str(wd / "lance" / "A" / "trajectories.lance")).to_table().sort_by("sample_id")
    assert resumed.drop_columns(["run_id"]).equals(t.drop_columns(["run_id"]))


def test_a_held_out_evaluation_that_leaves_a_prompt_alone_is_refused_with_a_group_reward(tiny_checkpoint,
                                                                                         tiny_dino, tmp_path):
    """The run's rewards score held-out prompts cycled up to run.eval_per_category: with the
    diversity reward (a group reward) every prompt needs two samples, checked before any work."""
    from pixrl.stages.preflight import PreflightError, preflight

    for split in ("train", "heldout"):
        (tmp_path / f"{split}.txt").write_text("a red circle\na blue square\na green triangle\n")
    over = [*tiny_overrides(tiny_checkpoint, tmp_path), "dataset=text_prompts", f"dataset.path={tmp_path / 'train.txt'}",
            f"dataset.heldout_path={tmp_path / 'heldout.txt'}", "run.eval_every=1", "algorithm.auxiliary=[brisque]",
            "reward.weights={jpeg_compressibility: 1.0, brisque: 0.0, diversity: 0.0}",
            f"reward.options.diversity.path={tiny_dino}", "algorithm.proxy=jpeg_compressibility",
            "algorithm.diversity=diversity"]
    with pytest.raises(PreflightError, match=r"gives 2 prompt\(s\) one sample.*run.eval_per_category"):
        preflight(load_config("shapes_gardo", [*over, "run.eval_per_category=4"]))
    preflight(load_config("shapes_gardo", [*over, "run.eval_per_category=6"]))
