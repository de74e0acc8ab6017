"""DDPO: ddpo-pytorch's advantages (per-prompt statistics once a prompt has min_count rewards,
the batch's otherwise), the DDIM-η kernel's identities on a flow-matching grid, its refusals,
and the online loop training DDPO on the miniature through the real flow."""

import json
import math

import lance
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.ddpo import ddpo_advantages
from pixrl.algorithms.flow_sde import ddim_moments, flow_step, vp_norm
from pixrl.cli import app
from pixrl.config.schema import AlgorithmConfig, SamplingConfig


def _tracker(rewards, prompts, min_count):
    """ddpo-pytorch's PerPromptStatTracker.update on a fresh tracker, written out per its formula."""
    out = np.empty_like(rewards)
    for p in np.unique(prompts):
        r = rewards[prompts == p]
        pool = r if len(r) >= min_count else rewards
        out[prompts == p] = (r - np.mean(pool)) / (np.std(pool) + 1e-6)
    return out


def test_advantages_are_per_prompt_once_a_prompt_has_min_count():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=20)
    prompts = np.array([0] * 8 + [1] * 8 + [2] * 4)  # prompt 2 has fewer than min_count
    got = ddpo_advantages(rewards, prompts, per_prompt=True, min_count=8, clip=100.0)
    assert np.allclose(got.advantages, _tracker(rewards, prompts, 8), atol=1e-6)
    r2 = rewards[prompts == 2]
    assert np.allclose(got.advantages[16:], (r2 - rewards.mean()) / (rewards.std() + 1e-6), atol=1e-6)
    plain = ddpo_advantages(rewards, prompts, per_prompt=False, clip=100.0)
    assert np.allclose(plain.advantages, (rewards - rewards.mean()) / (rewards.std() + 1e-8), atol=1e-6)
    clipped = ddpo_advantages(np.array([0.0] * 15 + [1.0]), np.zeros(16), min_count=16, clip=2.0)
    assert clipped.advantages.max() == 2.0 and clipped.zero_std_ratio == 0.0
    flat = ddpo_advantages(np.ones(16), np.repeat([0, 1], 8), min_count=8)
    assert flat.zero_std_ratio == 1.0 and not flat.keep.any()


def test_ddim_kernel_on_a_flow_grid():
    """η = 0 is the Euler ODE step; the first step from σ = 1 (ᾱ = 0) is finite; the step onto σ = 0
    (ᾱ' = 1) has no spread; moments match the DDPO formula in ᾱ written out."""
    g = torch.Generator().manual_seed(0)
    x, v, z = (torch.randn((2, 4, 6, 6), generator=g) for _ in range(3))
    for s, sn in ((1.0, 0.8), (0.6, 0.45), (0.2, 0.0)):
        ode = flow_step(v, x, torch.tensor(s), torch.tensor(sn), 0.8, 0.0, "sde")
        ddim0 = flow_step(v, x, torch.tensor(s), torch.tensor(sn), 0.8, 0.0, "ddim")
        assert torch.allclose(ddim0.prev_sample, ode.prev_sample, atol=1e-5)
    out = flow_step(v, x, torch.tensor(1.0), torch.tensor(0.8), 0.8, 1.0, "ddim", noise=z)
    assert torch.isfinite(out.log_prob).all() and (out.std > 0).all()
    assert (flow_step(v, x, torch.tensor(0.2), torch.tensor(0.0), 0.8, 1.0, "ddim", noise=z).std == 0).all()
    s, sn = torch.tensor(0.6), torch.tensor(0.45)
    ab = ((1 - s) / vp_norm(s)) ** 2
    abn = ((1 - sn) / vp_norm(sn)) ** 2
    eta = 0.7
    std = eta * torch.sqrt((1 - abn) / (1 - ab) * (1 - ab / abn))
    x_vp = x / vp_norm(s)
    eps = x + (1 - s) * v  # ε̂ and x̂0 of the velocity, as x_vp = √ᾱ x̂0 + √(1−ᾱ) ε̂
    x0 = (x_vp - torch.sqrt(1 - ab) * eps) / torch.sqrt(ab)
    mean = torch.sqrt(abn) * x0 + torch.sqrt(1 - abn - std**2) * eps
    got_mean, got_std = ddim_moments(x, v, s, sn, eta)
    assert torch.allclose(got_mean, mean, atol=1e-5) and torch.allclose(got_std, std, atol=1e-7)
    step = flow_step(v, x, s, sn, 0.8, eta, "ddim", noise=z)
    x_next_vp = step.prev_sample / vp_norm(sn)
    lp = (-(x_next_vp - mean) ** 2 / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))
    assert torch.allclose(step.log_prob, lp, atol=1e-4)


def test_sampling_settings_ddpo_refuses():
    algo = build_algorithm(AlgorithmConfig(name="ddpo"))
    for bad, message in (({"sde_type": "sde"}, "sampling.sde_type=ddim"),
                         ({"sde_type": "ddim", "noise_level": 1.5}, r"in \(0, 1\]"),
                         ({"sde_type": "ddim", "noise_level": 1.0, "window_size": 2}, "unset sampling.window_size")):
        with pytest.raises(ValueError, match=message):
            algo.check_sampling(SamplingConfig(**bad), "denoise")
    algo.check_sampling(SamplingConfig(sde_type="ddim", noise_level=1.0), "denoise")


def test_the_online_loop_trains_ddpo_on_the_miniature(tiny_checkpoint, tmp_path, prefect_harness):
    """shapes_ddpo's recipe through the real flow: 3 of 4 DDIM-η steps stored (the last, onto σ = 0,
    is deterministic), all trained, every sample in the loss; storing the last one is refused by name."""
    base = ["--config", "shapes_ddpo", "reward=jpeg_compressibility", *tiny_overrides(tiny_checkpoint, tmp_path),
            "sampling.window_size=null", "sampling.window_range=null", "algorithm.min_count=4"]
    res = CliRunner().invoke(app, ["train", "-n", "2", "--run", "ddpo", *base, "sampling.timestep_fraction=0.75"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    t = lance.dataset(out["table_uri"]).to_table()
    recipe = json.loads(t["recipe"][0].as_py())
    assert recipe["sde_type"] == "ddim" and recipe["noise_level"] == 1.0 and recipe["train_steps"] == [0, 1, 2]
    assert t.num_rows == 16 and all(np.isfinite(r).all() for r in t["log_probs"].to_pylist())
    for _, adv in t.to_pandas().groupby(["iteration", "group_id"])["advantage"]:
        assert abs(float(np.mean(adv))) < 1e-5  # groups of 4 ≥ min_count 4: each prompt's own statistics
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert [m.value for m in client.get_metric_history(out["run_id"], "samples_trained")] == [8.0, 8.0]
    res = CliRunner().invoke(app, ["train", "-n", "1", "--run", "ddpo_last", *base, "sampling.timestep_fraction=1.0"])
    assert res.exit_code != 0 and "step 3 of the rollout grid ends at σ = 0" in res.output, res.output
    assert not (tmp_path / "lance" / "ddpo_last").exists()


class _DequeTracker:
    """ddpo-pytorch's PerPromptStatTracker (stat_tracking.py), written out: a deque of each
    prompt's last `buffer` rewards across calls, its own statistics from `min_count` on."""

    def __init__(self, buffer: int, min_count: int):
        from collections import deque

        self.buffer, self.min_count, self.stats, self.deque = buffer, min_count, {}, deque

    def update(self, prompts: np.ndarray, rewards: np.ndarray) -> np.ndarray:
        adv = np.empty_like(rewards)
        for p in np.unique(prompts):
            r = rewards[prompts == p]
            d = self.stats.setdefault(p, self.deque(maxlen=self.buffer))
            d.extend(r)
            pool = d if len(d) >= self.min_count else rewards
            adv[prompts == p] = (r - np.mean(pool)) / (np.std(pool) + 1e-6)
        return adv


def test_the_deque_tracker_keeps_each_prompt_s_rewards_across_iterations():
    rng = np.random.default_rng(1)
    ours, theirs = {}, _DequeTracker(buffer=6, min_count=5)
    for _ in range(4):
        prompts = np.array(["a"] * 3 + ["b"] * 3 + ["c"] * 2)
        rewards = rng.normal(size=8)
        got = ddpo_advantages(rewards, np.repeat([0, 1, 2], [3, 3, 2]), min_count=5, clip=100.0,
                              prompts=list(prompts), history={k: np.array(v) for k, v in ours.items()}, buffer_size=6)
        assert np.allclose(got.advantages, theirs.update(prompts, rewards), atol=1e-6)
        for p, r in zip(prompts, rewards):
            ours.setdefault(p, []).append(r)


def test_the_loop_reads_the_deque_from_the_store_and_forks_read_the_parent_s(tiny_checkpoint, tmp_path,
                                                                              prefect_harness):
    """Two prompts, groups of 4, min_count 8: a prompt's own statistics start at its second
    iteration, from the rewards the store holds. The stored advantages equal ddpo-pytorch's tracker
    run over the iterations; a fork from score at iteration 2 reads the parent's past."""
    prompts = tmp_path / "two.txt"
    prompts.write_text("a red circle\na blue square\n")
    base = ["--config", "shapes_ddpo", "reward=jpeg_compressibility", *tiny_overrides(tiny_checkpoint, tmp_path),
            "sampling.window_size=null", "sampling.window_range=null", "sampling.timestep_fraction=0.75",
            f"dataset.path={prompts}", "dataset.categories=null", "algorithm.min_count=8", "algorithm.buffer_size=16"]
    res = CliRunner().invoke(app, ["train", "-n", "3", "--run", "P", *base])
    assert res.exit_code == 0, res.output
    t = lance.dataset(str(tmp_path / "lance" / "P" / "trajectories.lance")).to_table(
        columns=["iteration", "sample_id", "prompt", "reward", "advantage"]).sort_by([("iteration", "ascending"),
                                                                                     ("sample_id", "ascending")])
    tracker = _DequeTracker(buffer=16, min_count=8)
    it = t["iteration"].to_numpy()
    for i in range(3):
        rows = it == i
        rewards = t["reward"].to_numpy()[rows].astype(np.float64)
        want = np.clip(tracker.update(np.array(t["prompt"].to_pylist())[rows], rewards), -5, 5)
        assert np.allclose(t["advantage"].to_numpy()[rows], want, atol=1e-5)
    assert abs(float(np.mean(t["advantage"].to_numpy()[it == 0]))) < 1e-5  # iteration 0: the batch's statistics
    out = CliRunner().invoke(app, ["replay", "P", "--iteration", "2", "--from-stage", "score", "--into", "F",
                                   "--workdir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    f = lance.dataset(str(tmp_path / "lance" / "F" / "trajectories.lance")).to_table(
        columns=["sample_id", "advantage"]).sort_by("sample_id")
    assert f["advantage"].equals(t.filter(it == 2).select(["sample_id", "advantage"]).sort_by("sample_id")["advantage"])


def test_the_deque_is_refused_with_per_reward_advantages(tiny_checkpoint, tmp_path):
    res = CliRunner().invoke(app, ["train", "-n", "1", "--config", "shapes_ddpo", *tiny_overrides(tiny_checkpoint, tmp_path),
                                   "sampling.window_size=null", "sampling.window_range=null",
                                   "reward.weights={shapes: 1.0, jpeg_compressibility: 0.5}", "reward.aggregate=advantage"])
    assert res.exit_code == 2 and "set reward.aggregate=reward" in " ".join(res.output.split()), res.output
    assert not (tmp_path / "lance").exists()
