"""TempFlow-GRPO (algorithms.md §6.1) against its reference formulas: per-step process-reward
advantages as flow_grpo's PerPromptStatTracker computes them on a [samples, steps] reward array,
the noise-aware weight 2.25·s_t·sqrt(−Δ) on the PPO-clip loss, the branch parts and their union
for replay, and the settings it refuses. The flow itself (branches stored, shared base latents,
ratio exactly 1, resume) is `tests/test_seed_algorithms.py -k tempflow`."""

import json
import math

import numpy as np
import pytest
import torch

from pixrl.algorithms.advantages import group_advantages, per_part
from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.flow_grpo import Transition
from pixrl.algorithms.flow_sde import flow_step
from pixrl.algorithms.recipe import replay_recipe
from pixrl.algorithms.replay import ReplayPolicy
from pixrl.algorithms.sampling import SamplerRecipe
from pixrl.config.schema import AlgorithmConfig, SamplingConfig


def _algo(**kw):
    return build_algorithm(AlgorithmConfig(name="tempflow_grpo", **kw))


def _stat_tracker(prompts, rewards, global_std):
    """flow_grpo's PerPromptStatTracker.update(type='grpo') on 2-D rewards [N, T], written out:
    per prompt, the axis-0 mean; the std of the prompt's rows (or of every row), + 1e-4."""
    prompts, adv = np.array(prompts), np.zeros_like(rewards)
    for p in np.unique(prompts):
        r = rewards[prompts == p]
        std = (np.std(rewards, axis=0, keepdims=True) if global_std else np.std(r, axis=0, keepdims=True)) + 1e-4
        adv[prompts == p] = (r - np.mean(r, axis=0, keepdims=True)) / std
    return adv


@pytest.mark.parametrize("global_std", [False, True])
def test_part_advantages_equal_the_stat_tracker_on_each_step_column(global_std):
    rng = np.random.default_rng(0)
    P, B, K, T = 3, 2, 3, 4  # prompts, bases, children, branch steps
    rewards = rng.normal(size=(P * B * K, T))  # row (prompt, base, child); column: the branch step
    prompts = [f"p{i // (B * K)}" for i in range(P * B * K)]
    want = _stat_tracker(prompts, rewards, global_std)
    # pixrl's rows: part j holds every prompt's group at step j, group slot j·P + prompt
    flat = np.concatenate([rewards[:, j] for j in range(T)])
    groups = np.concatenate([j * P + np.arange(P * B * K) // (B * K) for j in range(T)])
    est = per_part(lambda r, g: group_advantages(r, g, global_std, 1e-4, 5.0), groups // P)
    got = est(flat, groups)
    np.testing.assert_allclose(got.advantages, np.concatenate([want[:, j] for j in range(T)]), rtol=1e-5, atol=1e-6)
    assert got.zero_std_ratio == 0.0


def test_part_advantages_count_flat_groups_of_every_part():
    r = np.array([1.0, 1.0, 0.0, 2.0, 3.0, 3.0, 5.0, 5.0])
    g = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    got = per_part(lambda r, g: group_advantages(r, g, False), g // 2)(r, g)
    assert got.zero_std_ratio == 0.75 and got.keep.tolist() == [False, False, True, True] + [False] * 4


def test_the_loss_is_ppo_clip_weighted_by_the_branch_steps_noise():
    """train_sd3_pr.py: unclipped = −2.25·std·A·ρ, clipped = −2.25·std·A·clip(ρ, 1±ε), loss =
    mean(max); std = s_t·sqrt(−Δ) with s_t = 0.7·sqrt(σ/(1 − σ)) (σ = 1 read as sigmas[1])."""
    torch.manual_seed(0)
    sigmas = torch.tensor([1.0, 0.8, 0.55, 0.3, 0.0])
    x, v = torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3)
    for k in (0, 2):
        old = flow_step(v, x, sigmas[k], sigmas[k + 1], float(sigmas[1]), 0.7, noise=torch.randn_like(x))
        new = flow_step(v + 0.01 * torch.randn_like(v), x, sigmas[k], sigmas[k + 1], float(sigmas[1]), 0.7,
                        prev_sample=old.prev_sample)
        sig = min(float(sigmas[k]), float(sigmas[1]))
        std = 0.7 * math.sqrt(float(sigmas[k]) / (1 - sig)) * math.sqrt(float(sigmas[k] - sigmas[k + 1]))
        assert torch.allclose(new.std, torch.full((4,), std), rtol=1e-6)
        adv = torch.tensor([1.0, -0.5, 2.0, -3.0])
        batch = {"log_probs": old.log_prob.numpy()[:, None], "stored_steps": np.full((4, 1), k, np.int32)}
        policy = ReplayPolicy(None, None, None, None, sigmas, None, None, torch.device("cpu"))
        loss, m = _algo(clip_range=1e-2).step_loss(Transition(0, k, x, old.prev_sample, new), batch, adv, policy)
        ratio = torch.exp(new.log_prob - old.log_prob)
        ref = torch.maximum(-2.25 * std * adv * ratio, -2.25 * std * adv * torch.clamp(ratio, 1 - 1e-2, 1 + 1e-2))
        assert torch.allclose(loss, ref.mean(), rtol=1e-5) and m["noise_weight"] == pytest.approx(2.25 * std)
        flat, _ = _algo(clip_range=1e-2, weighting="none").step_loss(Transition(0, k, x, old.prev_sample, new), batch,
                                                                     adv, policy)
        assert torch.allclose(loss, 2.25 * std * flat, rtol=1e-5)


def test_one_part_per_branch_step_and_their_union_for_replay():
    s = SamplingConfig(steps=10, group_size=8, timestep_fraction=0.99)
    a = _algo(children=4)
    parts = a.rollout_parts(s, np.random.default_rng(0), "denoise", 0)
    assert [(p.sde_steps, p.train_steps) for p in parts] == [((j,), (j,)) for j in range(9)]
    assert all(p.shared_noise and p.shared_members == 4 for p in parts)
    rows = [json.dumps({**p.to_dict(), "resolution": [4, 2, 2]}) for p in parts for _ in range(3)]
    union = replay_recipe(rows, "denoise")
    assert union.train_steps == union.sde_steps == tuple(range(9)) and union.noise_level == s.noise_level
    assert replay_recipe(rows[:3], "denoise") == parts[0]  # one part: its own recipe
    odd = json.dumps({**SamplerRecipe(10, 0.5, "sde", 1.0, (3,), (3,)).to_dict()})
    with pytest.raises(ValueError, match="differ beyond their stochastic"):
        replay_recipe(rows + [odd], "denoise")
    assert [p.train_steps for p in _algo(branch_steps=[0, 4]).rollout_parts(s, None, "denoise", 0)] == [(0,), (4,)]


@pytest.mark.parametrize("sampling, algo, match", [
    ({"group_size": 6}, {"children": 4}, "multiple of algorithm.children"),
    ({"max_rounds": 2}, {}, "max_rounds=1"),
    ({"window_size": 2}, {}, "unset sampling.window_size"),
    ({"sde_type": "dance"}, {}, "SDE or CPS"),
    ({}, {"branch_steps": [0, 10]}, "distinct steps of 0..9"),
    ({}, {"branch_steps": [1, 1]}, "distinct steps"),
])
def test_settings_it_cannot_train_on_are_refused(sampling, algo, match):
    s = SamplingConfig(**{"steps": 10, "group_size": 12, **sampling})
    with pytest.raises(ValueError, match=match):
        _algo(**{"children": 6, **algo}).check_sampling(s, "denoise")


def test_a_shared_prefix_is_sampled_once_per_base_and_matches_each_rows_own(tiny_checkpoint):
    """Rows with one prompt and one initial latent take the steps before their branch once (as
    upstream's sampler shares a base's prefix): fewer transformer rows, x_j equal within a base
    and within 1e-5 of sampling each row's prefix itself; the branch noise is each row's own, so
    the children differ; a stored transition replays to its own log-prob exactly."""
    from pixrl.algorithms.sampling import generators, replay_step, sample
    from pixrl.models.sd3 import SD3Family

    fam = SD3Family.load(tiny_checkpoint, max_sequence_length=0)
    prompts = ["a red circle"] * 4 + ["two blue squares"] * 4
    cond = fam.encode_prompts(prompts)
    seeds, bases = list(range(8)), [100, 100, 101, 101, 100, 100, 101, 101]  # 2 prompts × 2 bases × 2 children
    same = [0, 0, 2, 2, 4, 4, 6, 6]
    recipe = SamplerRecipe(4, 0.7, "sde", 1.0, (2,), (2,), shared_noise=True, shared_members=2)
    rows = []
    velocity = fam.velocity

    def counted(x, *a, **k):
        rows.append(len(x))
        return velocity(x, *a, **k)

    fam.velocity = counted
    try:
        shared = sample(fam, cond, None, generators(seeds), recipe, generators(bases), same)
        n_shared, rows[:] = sum(rows), []
        alone = sample(fam, cond, None, generators(seeds), recipe, generators(bases))
        n_alone = sum(rows)
    finally:
        del fam.velocity
    assert n_shared == 2 * 4 + 2 * 8 and n_alone == 4 * 8  # steps 0, 1 on the 4 bases; 2, 3 on every row
    x_j = shared.latents[:, 0]
    assert all(torch.equal(x_j[i], x_j[same[i]]) for i in range(8))
    assert torch.allclose(x_j, alone.latents[:, 0], atol=1e-5) and torch.allclose(shared.final, alone.final, atol=1e-4)
    assert not torch.equal(shared.next_latents[0, 0], shared.next_latents[1, 0])  # each child's own branch noise
    sig, ts = fam.schedule(4)
    out = replay_step(fam, x_j, shared.next_latents[:, 0], 2, sig, ts, cond, None, recipe)
    assert torch.equal(out.log_prob, shared.log_probs[:, 0])
