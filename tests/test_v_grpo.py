"""V-GRPO (Variational GRPO) on the tiny SD3 checkpoint: the pairs are one grid index per stratum
and one noise per group, from the update's seed; a loss term equals V-GRPO's step as the
reference implementation (VRL's `VGRPO.compute_batch_timestep_loss`, written out here) computes
it — the x-prediction, the adaptive weighting, the ratio to θ_old, the soft-clipped advantage,
the optional clip and KL — in value and gradient, at the update's first optimizer step (ρ = 1:
the loss is antisymmetric in the advantage) and after it (ρ to the update's starting weights);
a step moves a positive-advantage sample's x-prediction toward it; misuse is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import perturbed_sd3
from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.replay import ReplayPolicy
from pixrl.algorithms.sampling import SamplerRecipe, generators, sample
from pixrl.algorithms.v_grpo import group_noise, stratified_steps
from pixrl.config.schema import AlgorithmConfig, SamplingConfig
from pixrl.models.sd3 import SD3Family

PROMPTS = ["a red circle", "a red circle", "two blue squares", "two blue squares"]
GROUPS = np.array([3, 3, 8, 8], dtype=np.int32)
SEED = 1234


def _normalized_mse(prediction, target):
    """VRL's normalized_mse: the squared error over its detached mean absolute error (float64)."""
    dims = tuple(range(1, target.ndim))
    with torch.no_grad():
        weight = torch.abs(prediction.double() - target.double()).mean(dim=dims, keepdim=True).clip(min=1e-5)
    return ((prediction - target) ** 2 / weight).mean(dim=dims)


def _reference_term(fam, old, x0, adv, cond, t, timestep, noise, eta, clip_ratio, kl_coef):
    """VRL's compute_batch_timestep_loss for one pair, with its previous policy `old` (None: the
    weights themselves, as when the previous adapter was just synced)."""
    xt = (1 - t) * x0 + t * noise
    prediction = fam.velocity(xt, timestep, cond, 1.0, None)
    with torch.no_grad():
        old_prediction = (prediction if old is None else old.velocity(xt, timestep, cond, 1.0, None)).detach()
    x_pred = xt - t * prediction.float()
    x_old = xt - t * old_prediction.float()
    surrogate = _normalized_mse(x_pred, x0)
    with torch.no_grad():
        surrogate_old = _normalized_mse(x_old, x0)
    ratio = torch.exp(surrogate_old - surrogate)
    a = eta * torch.tanh(adv / eta) if eta is not None else adv
    unclipped = ratio * a
    if clip_ratio is not None:
        objective = torch.minimum(unclipped, torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio) * a)
    else:
        objective = unclipped
    return -objective.mean() + kl_coef * ((x_pred - x_old) ** 2).mean(), ratio


@pytest.fixture(scope="module")
def family(tiny_checkpoint):
    return SD3Family.load(tiny_checkpoint, max_sequence_length=0)


@pytest.fixture(scope="module")
def start(tiny_checkpoint):
    """A frozen copy of the tiny SD3 with other weights: the update's starting weights."""
    return perturbed_sd3(tiny_checkpoint, [21])[0]


@pytest.fixture(scope="module")
def rollout(family):
    cond = family.encode_prompts(PROMPTS)
    x0 = sample(family, cond, None, generators([1, 2, 3, 4]), SamplerRecipe(6, 0.0, train_steps=())).final
    return cond, x0


def test_pairs_are_one_index_per_stratum_and_one_noise_per_group():
    grid = list(range(10))
    seen = [set() for _ in range(4)]
    for seed in range(400):
        steps = stratified_steps(grid, 4, seed)
        for j, (k, lo, hi) in enumerate(zip(steps, [0, 2, 5, 7], [2, 5, 7, 10])):
            assert lo <= k < hi
            seen[j].add(k)
    assert seen == [{0, 1}, {2, 3, 4}, {5, 6}, {7, 8, 9}]  # every index of each stratum is drawn
    assert stratified_steps(grid, 4, 5) == stratified_steps(grid, 4, 5)
    assert stratified_steps([1, 3, 5, 7], 4, 5) == [1, 3, 5, 7]  # strata of the trained steps only
    noise = group_noise((2, 3, 3), GROUPS, SEED, 0)
    assert torch.equal(noise[0], noise[1]) and torch.equal(noise[2], noise[3]) and not torch.equal(noise[0], noise[2])
    assert not torch.equal(group_noise((2, 3, 3), GROUPS, SEED, 1)[0], noise[0])  # another pair
    assert not torch.equal(group_noise((2, 3, 3), GROUPS, SEED + 1, 0)[0], noise[0])  # another update
    assert torch.equal(group_noise((2, 3, 3), GROUPS[2:], SEED, 0)[0], noise[2])  # whichever micro-batch holds it


@pytest.mark.parametrize("after_a_step", [False, True])
def test_a_loss_term_is_v_grpos_step_value_and_gradient(family, start, rollout, after_a_step):
    settings = {"pairs": 3, "clip_range": 0.02, "kl_weight": 0.3} if after_a_step else {"pairs": 3}
    algo = build_algorithm(AlgorithmConfig(name="v_grpo", optimizer_steps_per_iteration=2, **settings))
    assert algo.frozen_slots() == ("start",)
    s = algo.settings
    cond, x0 = rollout
    sigmas, timesteps = family.schedule(6)
    adv = torch.tensor([4.0, -1.5, 0.4, -2.9])
    batch = {"final_latent": x0.numpy(), "advantage": adv.numpy(), "group_id": GROUPS}
    policy = ReplayPolicy(family, None, cond, None, sigmas, timesteps, SamplerRecipe(6, 0.0, train_steps=()),
                          torch.device("cpu"), torch.Generator().manual_seed(11), frozen={"start": start},
                          update_seed=SEED)
    algo.prepare_update(batch)
    if after_a_step:
        algo.after_optimizer_step({})
    params = [p for p in family.transformer.parameters() if p.requires_grad]
    steps = stratified_steps(list(range(6)), 3, SEED)
    terms = list(algo.losses(batch, policy))
    assert len(terms) == 3 == algo.terms(batch)
    clipped = []
    for j, (loss, metrics) in enumerate(terms):
        family.transformer.zero_grad()
        loss.backward()
        grads = [p.grad.clone() for p in params]
        k = steps[j]
        noise = group_noise(x0.shape[1:], GROUPS, SEED, j)
        want, ratio = _reference_term(family, start if after_a_step else None, x0, adv, cond, sigmas[k].float(),
                                      timesteps[k].reshape(1).expand(4), noise, s.soft_clip, s.clip_range,
                                      s.kl_weight)
        family.transformer.zero_grad()
        want.backward()
        assert abs(float(loss.detach()) - float(want.detach())) < 1e-6
        assert all(torch.allclose(g, p.grad, atol=1e-8, rtol=1e-4) for g, p in zip(grads, params))
        assert any(float(g.abs().max()) > 0 for g in grads)
        assert float(metrics["vgrpo/t"]) == pytest.approx(float(sigmas[k]))
        if after_a_step:  # a ratio to the update's starting weights
            assert float((ratio - 1).abs().min()) > 1e-4
            clipped.append(float(metrics["clipfrac"]))
        else:
            assert float(metrics["ratio_max"]) == float(metrics["ratio_min"]) == 1.0
    assert not after_a_step or max(clipped) > 0  # some of it clipped


def test_on_policy_the_loss_is_antisymmetric_in_the_advantage(family, rollout):
    """VRL's first-step invariant: ρ = 1 and no KL, so loss(A) = −loss(−A)."""
    algo = build_algorithm(AlgorithmConfig(name="v_grpo", optimizer_steps_per_iteration=1, pairs=2))
    cond, x0 = rollout
    sigmas, timesteps = family.schedule(6)

    def losses(adv):
        batch = {"final_latent": x0.numpy(), "advantage": adv, "group_id": GROUPS}
        policy = ReplayPolicy(family, None, cond, None, sigmas, timesteps, SamplerRecipe(6, 0.0, train_steps=()),
                              torch.device("cpu"), torch.Generator().manual_seed(2), update_seed=SEED)
        algo.prepare_update(batch)
        with torch.no_grad():
            return [float(loss) for loss, _ in algo.losses(batch, policy)]

    adv = np.array([1.0, -0.5, 2.0, -0.3], dtype=np.float32)
    got, flipped = losses(adv), losses(-adv)
    assert all(abs(a + b) < 1e-7 and abs(a) > 1e-6 for a, b in zip(got, flipped))


def test_a_step_pulls_a_positive_advantage_toward_its_sample(tiny_checkpoint, rollout):
    """One SGD step on a single sample: with A > 0 the x-prediction at the pair's x_t moves toward
    the sample; with A < 0 away from it."""
    cond, x0 = rollout
    for sign in (1.0, -1.0):
        fam = SD3Family.load(tiny_checkpoint, max_sequence_length=0)
        fam.transformer.requires_grad_(True)
        algo = build_algorithm(AlgorithmConfig(name="v_grpo", optimizer_steps_per_iteration=1, pairs=1))
        sigmas, timesteps = fam.schedule(6)
        batch = {"final_latent": x0[:1].numpy(), "advantage": np.array([sign], dtype=np.float32),
                 "group_id": GROUPS[:1]}
        policy = ReplayPolicy(fam, None, cond.select([0]), None, sigmas, timesteps,
                              SamplerRecipe(6, 0.0, train_steps=()), torch.device("cpu"), torch.Generator(),
                              update_seed=SEED)
        (k,) = stratified_steps(list(range(6)), 1, SEED)
        t, timestep = sigmas[k].float(), timesteps[k].reshape(1)
        x_t = (1 - t) * x0[:1] + t * group_noise(x0.shape[1:], GROUPS[:1], SEED, 0)

        def error():
            with torch.no_grad():
                return float(((x_t - t * fam.velocity(x_t, timestep, cond.select([0]), 1.0, None) - x0[:1]) ** 2).mean())

        before = error()
        opt = torch.optim.SGD([p for p in fam.transformer.parameters()], lr=1e-3)
        algo.prepare_update(batch)
        (loss, _), = list(algo.losses(batch, policy))
        loss.backward()
        opt.step()
        assert (error() < before) == (sign > 0)


def test_refusals():
    algo = build_algorithm(AlgorithmConfig(name="v_grpo"))
    with pytest.raises(ValueError, match="flow-matching"):
        algo.check_sampling(SamplingConfig(), "token")
    with pytest.raises(ValueError, match="pairs ≤ sampling.steps"):
        algo.check_sampling(SamplingConfig(steps=3), "denoise")
    with pytest.raises(ValueError, match="max_rounds=1"):
        algo.check_sampling(SamplingConfig(max_rounds=2), "denoise")
    with pytest.raises(Exception, match="soft_clip"):
        build_algorithm(AlgorithmConfig(name="v_grpo", soft_clp=2.0))
    with pytest.raises(Exception, match="clip_range"):
        build_algorithm(AlgorithmConfig(name="v_grpo", clip_range=1.5))
