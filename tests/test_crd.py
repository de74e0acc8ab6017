"""CRD (Centered Reward Distillation) on the tiny SD3 checkpoint: the centred reward-matching loss
is Flow-Factory's `CRDTrainer._compute_crd_loss` (written out here) applied within each prompt's
group, for every weighting and both loss types; a loss term equals CRD's step written out — the
interpolated latent, the adaptively weighted implicit reward against the old snapshot, the
centring, the m/β scale, the reward-adaptive KL to the CFG-guided base — in value and gradient;
the snapshots follow their decay schedules; misuse is refused before a run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import perturbed_sd3
from pixrl.algorithms.awm import AWMSettings, draw_levels
from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.crd import CRDSettings, crd_loss, implicit_reward, schedule_decay
from pixrl.algorithms.replay import ReplayPolicy
from pixrl.algorithms.sampling import SamplerRecipe, generators, sample
from pixrl.config.schema import AlgorithmConfig, SamplingConfig
from pixrl.models.sd3 import SD3Family

PROMPTS = ["a red circle", "a red circle", "a red circle", "two blue squares", "two blue squares",
           "two blue squares"]
GROUPS = np.array([5, 5, 5, 9, 9, 9], dtype=np.int32)


def _flow_factory_loss(adv_cur, r_theta, beta, loss_type, weight_temp):
    """CRDTrainer._compute_crd_loss on one process (adv_cur = adv_cur_rank, r_theta gathered = local)."""
    temp = torch.inf if weight_temp < 0 else weight_temp

    def direction(p):
        rc = adv_cur - (adv_cur * p).sum(dim=0, keepdim=True)
        r_c = r_theta - (r_theta * p).sum(dim=0, keepdim=True).detach()
        if loss_type == "bce":
            return F.binary_cross_entropy_with_logits(beta * r_c, torch.sigmoid(rc.detach()), reduction="mean")
        return ((beta * r_c - rc) ** 2).mean()

    if temp == torch.inf:
        return direction(torch.softmax(adv_cur / temp, dim=0))

    def hard(mask):  # Flow-Factory masks adv_cur > 0 / < 0; pixrl: above / below the centre ½ (docs)
        if mask.sum() == 0:
            return torch.ones_like(adv_cur) / adv_cur.shape[0]
        return torch.softmax(adv_cur.where(mask, torch.tensor(float("-inf"))), dim=0)

    plus = hard(adv_cur > 0.5) if temp == 0 else torch.softmax(adv_cur / temp, dim=0)
    minus = hard(adv_cur < 0.5) if temp == 0 else torch.softmax(-adv_cur / temp, dim=0)
    return 0.5 * direction(plus) + 0.5 * direction(minus)


@pytest.mark.parametrize("loss_type,weight_temp", [("mse", -1.0), ("bce", -1.0), ("mse", 0.0), ("mse", 0.7),
                                                   ("bce", 0.7)])
def test_the_centred_loss_is_flow_factorys_within_each_group(loss_type, weight_temp):
    g = torch.Generator().manual_seed(0)
    a = torch.rand(6, generator=g)
    a[3] = 0.2  # the second group: all below ½ but one (hard selection's uniform fallback on one side)
    a[4], a[5] = 0.1, 0.6
    r = torch.randn(6, generator=g, requires_grad=True)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    s = CRDSettings(beta=1.7, loss_type=loss_type, weight_temp=weight_temp)
    got = crd_loss(a, r, groups, s)
    (grad,) = torch.autograd.grad(got, r)
    want = 0.5 * (_flow_factory_loss(a[:3], r[:3], 1.7, loss_type, weight_temp)
                  + _flow_factory_loss(a[3:], r[3:], 1.7, loss_type, weight_temp))
    (want_grad,) = torch.autograd.grad(want, r)
    assert torch.allclose(got, want, atol=1e-6) and torch.allclose(grad, want_grad, atol=1e-6)
    # centring within the group: adding a constant to a group's implicit rewards changes nothing
    shifted = r.detach() + torch.tensor([0.0, 0.0, 0.0, 3.0, 3.0, 3.0])
    assert torch.allclose(crd_loss(a, shifted, groups, s), got.detach(), atol=1e-6)


def test_the_implicit_reward_and_the_decay_schedules():
    g = torch.Generator().manual_seed(1)
    v, v_old, u = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    plain = implicit_reward(v, v_old, u, adaptive=False)
    assert torch.allclose(plain, -((v - u) ** 2 - (v_old - u) ** 2).mean(dim=(1, 2, 3)))
    w = (v - u).abs().mean(dim=(1, 2, 3), keepdim=True)
    w_old = (v_old - u).abs().mean(dim=(1, 2, 3), keepdim=True)
    want = -((v - u) ** 2 / w - (v_old - u) ** 2 / w_old).mean(dim=(1, 2, 3))
    assert torch.allclose(implicit_reward(v, v_old, u, adaptive=True).float(), want, atol=1e-6)
    old, sampling = (0, 0.25, 0.005, 0.999), (75, 0.0, 0.0075, 0.999)
    assert schedule_decay(0, old) == 0.25 and schedule_decay(10, old) == pytest.approx(0.30)
    assert schedule_decay(1000, old) == 0.999
    assert schedule_decay(74, sampling) == 0.0 and schedule_decay(75, sampling) == 0.0
    assert schedule_decay(95, sampling) == pytest.approx(0.15) and schedule_decay(10 ** 4, sampling) == 0.999


@pytest.fixture(scope="module")
def family(tiny_checkpoint):
    return SD3Family.load(tiny_checkpoint, max_sequence_length=0)


def test_a_loss_term_is_crds_step_value_and_gradient(family, tiny_checkpoint):
    """Two whole groups of three, a CFG-free rollout; the old snapshot and the base are other
    weights; the KL's base guided at 4.5 with the negative prompt, reward-adaptive."""
    base, old = perturbed_sd3(tiny_checkpoint, [31, 32])
    algo = build_algorithm(AlgorithmConfig(name="crd", train_timesteps=3, kl_weight=0.2, beta=1.5))
    s = algo.settings
    assert algo.frozen_slots() == ("old",) and algo.guides_reference and algo.separate_sampler
    cond = family.encode_prompts(PROMPTS)
    neg = family.encode_prompts([""] * 6)
    x0 = sample(family, cond, None, generators([1, 2, 3, 4, 5, 6]), SamplerRecipe(6, 0.0, train_steps=())).final
    sigmas, timesteps = family.schedule(6)
    adv = torch.tensor([4.0, -1.0, 0.5, -6.0, 2.0, 0.2])
    batch = {"final_latent": x0.numpy(), "advantage": adv.numpy(), "group_id": GROUPS,
             "timesteps": [timesteps.numpy()] * 6}
    recipe = SamplerRecipe(6, 0.0, train_steps=(), guidance_scale=1.0)
    policy = ReplayPolicy(family, base, cond, neg, sigmas, timesteps, recipe, torch.device("cpu"),
                          torch.Generator().manual_seed(4), frozen={"old": old})
    params = [p for p in family.transformer.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(4)
    idx, on_grid = draw_levels(AWMSettings(train_timesteps=3, timestep_fraction=0.99, time_type="discrete"), 6, 6, gen)
    assert on_grid and algo.terms(batch) == 3
    a = torch.clamp((torch.clamp(adv, -5, 5) / 5) / 2 + 0.5, 0, 1)
    terms = list(algo.losses(batch, policy))
    for j, (loss, metrics) in enumerate(terms):
        family.transformer.zero_grad()
        loss.backward()
        grads = [p.grad.clone() for p in params]
        k = idx[j]
        noise = torch.randn(x0.shape, generator=gen)
        t = sigmas[k].float().view(-1, 1, 1, 1)
        x_t, target = (1 - t) * x0 + t * noise, noise - x0
        v = family.velocity(x_t, timesteps[k], cond, 1.0, None)
        with torch.no_grad():
            v_old = old.velocity(x_t, timesteps[k], cond, 1.0, None)
            v_ref = base.velocity(x_t, timesteps[k], cond, 4.5, neg)
        w = (v.detach().double() - target.double()).abs().mean(dim=(1, 2, 3), keepdim=True).clip(min=1e-5)
        w_old = (v_old.double() - target.double()).abs().mean(dim=(1, 2, 3), keepdim=True).clip(min=1e-5)
        r = -((v - target) ** 2 / w - (v_old - target) ** 2 / w_old).mean(dim=(1, 2, 3))
        policy_loss = 0.5 * (_flow_factory_loss(a[:3], r[:3], 1.5, "mse", -1.0)
                             + _flow_factory_loss(a[3:], r[3:], 1.5, "mse", -1.0)) * 5.0 / 1.5
        kl_div = ((v - v_ref) ** 2).mean(dim=(1, 2, 3))
        min_coef = 1e-4 / 0.2
        want = policy_loss + 0.2 * torch.mean((min_coef + a * (1 - min_coef)) * kl_div)
        family.transformer.zero_grad()
        want.backward()
        assert abs(float(loss.detach()) - float(want.detach())) < 1e-6 * max(1.0, abs(float(want.detach())))
        assert all(torch.allclose(g, p.grad, atol=1e-6, rtol=1e-4) for g, p in zip(grads, params))
        assert any(float(g.abs().max()) > 0 for g in grads)
        assert float(metrics["kl"]) > 0 and abs(float(metrics["crd/implicit_reward"])) > 0
    assert s.kl_weight == 0.2 and len(terms) == 3


def test_the_snapshots_follow_their_schedules():
    algo = build_algorithm(AlgorithmConfig(name="crd", optimizer_steps_per_iteration=2))
    start = {"w": torch.zeros(3)}
    assert algo.frozen_weights("old", start) is algo.frozen_weights("old", {"w": torch.ones(3)})  # first: the start
    algo.set_sampling_weights({"w": torch.zeros(3)})
    metrics = algo.end_of_update({"w": torch.ones(3)}, 2)  # step 2: old decay 0.26, sampling 0 (before 75)
    assert metrics == {"crd/old_decay": pytest.approx(0.26), "crd/sampling_decay": 0.0}
    assert torch.allclose(algo.state()["old"]["w"], torch.full((3,), 0.74))
    assert torch.equal(algo.sampling_weights()["w"], torch.ones(3))
    restored = build_algorithm(AlgorithmConfig(name="crd"))
    restored.load_state(algo.state())
    assert restored.state()["step"] == 2 and torch.equal(restored.state()["old"]["w"], algo.state()["old"]["w"])


def test_misuse_is_refused(tiny_flux):
    from pixrl.models.flux import FluxFamily

    algo = build_algorithm(AlgorithmConfig(name="crd"))
    ok = SamplingConfig(steps=10, group_size=4, prompts_per_iteration=2, micro_batch=8)
    algo.check_sampling(ok, "denoise")
    with pytest.raises(ValueError, match="whole groups"):
        algo.check_sampling(ok.model_copy(update=dict(micro_batch=6)), "denoise")
    with pytest.raises(ValueError, match="max_rounds=1"):
        algo.check_sampling(ok.model_copy(update=dict(max_rounds=2)), "denoise")
    with pytest.raises(ValueError, match="flow-matching"):
        algo.check_sampling(ok, "token")
    with pytest.raises(ValueError, match="guidance-distilled.*kl_guidance=1"):
        algo.check_family(FluxFamily)
    build_algorithm(AlgorithmConfig(name="crd", kl_guidance=1.0)).check_family(FluxFamily)
    with pytest.raises(Exception, match="weight_temp"):
        build_algorithm(AlgorithmConfig(name="crd", weight_tmp=0.5))
