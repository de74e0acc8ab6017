"""DGPO (Direct Group Preference Optimization) on the tiny SD3 checkpoint: the group weights and
the DSM clipping are DGPO's (Luo-Yihong/DGPO's train script, written out here); a loss term
equals DGPO's step written out — one noise per group, the conditional velocity, the base's DSM,
the EMA reference's ratio and clip, the group sigmoid, the KL — in value and gradient; the EMA
reference moves after each update and takes the rollouts after `switch_ema_ref` steps; misuse
(a micro-batch splitting a group, several optimizer steps per update, a guided reference on a
guidance-distilled family) is refused before a run; a CFG-free rollout with a guided reference
replays with the negative prompt encoded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import perturbed_sd3
from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.dgpo import whole_groups, clipped_dsm, group_weights
from pixrl.algorithms.replay import ReplayPolicy
from pixrl.algorithms.sampling import SamplerRecipe, generators, sample
from pixrl.config.schema import AlgorithmConfig, SamplingConfig
from pixrl.models.sd3 import SD3Family

PROMPTS = ["a red circle", "a red circle", "two blue squares", "two blue squares"]


def _dgpo_loss(model_v, ref_v, target_v, adv, groups, beta_dpo, group_size, dsm_loss=None):
    """compute_group_dgpo_loss_allreduce on one process, as DGPO writes it."""
    b = model_v.shape[0]
    if dsm_loss is None:
        dsm_loss = (target_v - model_v).square().reshape(b, -1).mean(dim=1)
    with torch.no_grad():
        ref_dsm_loss = (target_v - ref_v).square().reshape(b, -1).mean(dim=1)
    per_sample = adv * beta_dpo * (dsm_loss.detach() - ref_dsm_loss.detach()) / group_size
    sums = torch.zeros(int(groups.max()) + 1, dtype=per_sample.dtype).scatter_add_(0, groups, per_sample)
    weights = torch.sigmoid(sums)[groups]
    return (weights.detach() * adv * dsm_loss).mean()


def test_group_weights_and_clipping_are_dgpos():
    g = torch.Generator().manual_seed(0)
    v, ref, target = (torch.randn(6, 2, 3, 3, generator=g) for _ in range(3))
    v.requires_grad_(True)
    adv = torch.tensor([1.2, -0.4, -0.8, 0.5, 0.0, -0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    dsm = ((target - v) ** 2).mean(dim=(1, 2, 3))
    ref_dsm = ((target - ref) ** 2).mean(dim=(1, 2, 3))
    w = group_weights(adv, dsm, ref_dsm, groups, 100.0, 3)
    ours = (w.detach() * adv * dsm).mean()
    (grad,) = torch.autograd.grad(ours, v)
    want = _dgpo_loss(v, ref, target, adv, groups, 100.0, 3)
    (want_grad,) = torch.autograd.grad(want, v)
    assert torch.equal(ours, want) and torch.equal(grad, want_grad)
    assert torch.all(w[:3] == w[0]) and torch.all(w[3:] == w[3]) and w[0] != w[3]  # one weight per group
    # the ratio exp(ℓ_old − ℓ) leaving 1 ± c in the advantage's direction stops that sample's gradient
    dsm = torch.tensor([1.0, 1.0, 1.0, 1.0], requires_grad=True)
    old = torch.tensor([1.05, 0.95, 0.95, 1.05])  # ρ > 1.01, < 0.99, < 0.99, > 1.01
    a = torch.tensor([1.0, 1.0, -1.0, -1.0])
    out, clip = clipped_dsm(dsm, old, a, 1e-2)
    assert clip.tolist() == [True, False, True, False]
    out.sum().backward()
    assert dsm.grad.tolist() == [0.0, 1.0, 0.0, 1.0]


@pytest.fixture(scope="module")
def family(tiny_checkpoint):
    return SD3Family.load(tiny_checkpoint, max_sequence_length=0)


@pytest.fixture(scope="module")
def moved(tiny_checkpoint):
    """Frozen copies with other weights: the base reference and the EMA reference."""
    return perturbed_sd3(tiny_checkpoint, [20, 21])


@pytest.mark.parametrize("kl_guidance", [1.0, 3.0])
def test_a_loss_term_is_dgpos_step_value_and_gradient(family, moved, kl_guidance):
    """Two whole groups of two; the rollout had CFG (a negative batch) and the training forward is
    the conditional velocity; reference and EMA reference are other weights; with kl_guidance the
    reference is guided by the rollout's negative prompt (DGPO's kl_cfg)."""
    algo = build_algorithm(AlgorithmConfig(name="dgpo", train_levels=2, trunc_steps=2, clip_range=0.02,
                                           kl_weight=0.05, beta_dpo=50.0, kl_guidance=kl_guidance))
    base, ema = moved
    cond = family.encode_prompts(PROMPTS)
    neg = family.encode_prompts([""] * len(PROMPTS))
    grid = SamplerRecipe(4, 0.0, train_steps=())
    x0 = sample(family, cond, None, generators([1, 2, 3, 4]), grid).final
    sigmas, timesteps = family.schedule(4)
    adv = torch.tensor([1.1, -1.1, 0.7, -0.7])
    batch = {"final_latent": x0.numpy(), "advantage": adv.numpy(), "group_id": np.array([3, 3, 5, 5])}
    policy = ReplayPolicy(family, base, cond, neg, sigmas, timesteps, SamplerRecipe(4, 0.0, guidance_scale=4.5),
                          torch.device("cpu"), torch.Generator().manual_seed(5), frozen={"ema_ref": ema})
    params = [p for p in family.transformer.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(5)
    levels = torch.randperm(3, generator=gen)[:2].tolist()
    groups = torch.tensor([0, 0, 1, 1])
    got = list(algo.losses(batch, policy))
    assert len(got) == algo.terms(batch) == 2
    clipped_any = False
    for (loss, metrics), j in zip(got, levels):
        family.transformer.zero_grad()
        loss.backward()
        grads = [p.grad.clone() for p in params]
        noise = torch.randn(2, *x0.shape[1:], generator=gen)[groups]  # one per group
        t = sigmas[j].float()
        xt = (1 - t) * x0 + t * noise
        target = noise - x0
        ts = timesteps[j].reshape(1).expand(4)
        model_v = family.velocity(xt, ts, cond, 1.0, None)  # the conditional velocity (cfg = False)
        with torch.no_grad():
            ref_v = base.velocity(xt, ts, cond, kl_guidance, neg if kl_guidance > 1 else None)
            old_v = ema.velocity(xt, ts, cond, 1.0, None)
        dsm = (target - model_v).square().reshape(4, -1).mean(dim=1)
        old_dsm = (target - old_v).square().reshape(4, -1).mean(dim=1)
        ratio = torch.exp(-dsm + old_dsm)
        should_clip = torch.where(adv > 0, ratio > 1.0 + 0.02, ratio < 1.0 - 0.02)
        clipped_any |= bool(should_clip.any())
        dsm = torch.where(should_clip, dsm.detach(), dsm)
        want = _dgpo_loss(model_v, ref_v, target, adv, groups, 50.0, 2, dsm)
        want = want + 0.05 * (model_v - ref_v).square().reshape(4, -1).mean(dim=1).mean()
        family.transformer.zero_grad()
        want.backward()
        assert abs(float(loss.detach()) - float(want.detach())) < 1e-6
        assert all(torch.allclose(g, p.grad, atol=1e-8, rtol=1e-4) for g, p in zip(grads, params))
        assert any(float(g.abs().max()) > 0 for g in grads)
        assert float(metrics["clipfrac"]) == pytest.approx(float(should_clip.double().mean()))
    assert clipped_any, "the EMA reference's weights are far enough to clip some sample"
    family.transformer.zero_grad()


def test_the_ema_reference_moves_after_each_update_and_takes_the_rollouts_after_the_switch():
    algo = build_algorithm(AlgorithmConfig(name="dgpo", switch_ema_ref=1, ema_ref_decay=0.3))
    assert algo.separate_sampler and algo.frozen_slots() == ("ema_ref",)
    start = {"w": torch.tensor([1.0, 2.0])}
    algo.set_sampling_weights(start)  # the update's start seeds the reference; the rollouts keep the weights
    assert algo.sampling_weights() is None
    algo.after_optimizer_step({})
    after = {"w": torch.tensor([3.0, 0.0])}
    assert algo.end_of_update(after, 1)["dgpo/ema_decay"] == 0.0  # d = 0.001·(steps before): the weights
    assert torch.equal(algo.state()["ema"]["w"], after["w"]) and algo.sampling_weights() is None
    algo.after_optimizer_step({})
    latest = {"w": torch.tensor([5.0, 1.0])}
    got = algo.end_of_update(latest, 1)
    assert got == {"dgpo/ema_decay": pytest.approx(0.001), "dgpo/samples_with_ema": 1.0}
    assert torch.allclose(algo.sampling_weights()["w"], 0.001 * after["w"] + 0.999 * latest["w"])
    never = build_algorithm(AlgorithmConfig(name="dgpo", switch_ema_ref=None, clip_dsm=False))
    assert not never.separate_sampler and never.frozen_slots() == () and never.end_of_update(latest, 1) == {}


def test_misuse_is_refused():
    algo = build_algorithm(AlgorithmConfig(name="dgpo", optimizer_steps_per_iteration=1))
    ok = SamplingConfig(steps=10, group_size=4, prompts_per_iteration=2, micro_batch=8, guidance_scale=4.5)
    algo.check_sampling(ok, "denoise")
    for bad, words in [(dict(micro_batch=2), "whole groups"), (dict(steps=4), "trunc_steps"),
                       (dict(max_rounds=2), "max_rounds=1")]:
        with pytest.raises(ValueError, match=words):
            algo.check_sampling(ok.model_copy(update=bad), "denoise")
    with pytest.raises(ValueError, match="optimizer_steps_per_iteration=1"):
        build_algorithm(AlgorithmConfig(name="dgpo", optimizer_steps_per_iteration=2)).check_sampling(ok, "denoise")
    guided = build_algorithm(AlgorithmConfig(name="dgpo", kl_guidance=4.5, optimizer_steps_per_iteration=1))
    guided.check_sampling(ok.model_copy(update=dict(guidance_scale=1.0)), "denoise")  # dgpo_wocfg: allowed
    assert guided.guides_reference and not algo.guides_reference
    with pytest.raises(ValueError, match="flow-matching"):
        algo.check_sampling(ok, "token")
    with pytest.raises(ValueError, match="every group must be whole"):
        whole_groups(np.array([1, 1, 2]), torch.device("cpu"))


def test_a_cfg_free_rollout_with_a_guided_reference_replays_with_the_negative_prompt(family):
    """DGPO's dgpo_wocfg: rollouts at guidance 1 batch no negative prompt; kl_guidance > 1 has the
    replay encode sampling.negative_prompt for the reference (a CFG family only)."""
    from pixrl.models.base import replay_negative

    recipe = SamplerRecipe(4, 0.0, guidance_scale=1.0, negative_prompt="blurry")
    plain = build_algorithm(AlgorithmConfig(name="dgpo", optimizer_steps_per_iteration=1))
    guided = build_algorithm(AlgorithmConfig(name="dgpo", kl_guidance=4.5, optimizer_steps_per_iteration=1))
    assert replay_negative(family, recipe, plain) is None
    assert replay_negative(family, recipe, guided) == "blurry"
    cfg_recipe = SamplerRecipe(4, 0.0, guidance_scale=4.5, negative_prompt="ugly")
    assert replay_negative(family, cfg_recipe, plain) == replay_negative(family, cfg_recipe, guided) == "ugly"

