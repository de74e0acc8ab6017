"""The SDE/CPS step and its log-prob against algorithms.md §2.1-2.2 and §17.1/17.3."""

import math

import torch

from pixrl.algorithms.flow_sde import flow_step, kl_to_reference

SIGMAS = torch.tensor([1.0, 0.9, 0.7, 0.4, 0.0])


def _xv(seed=0, b=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 4, 5, 5, generator=g), torch.randn(b, 4, 5, 5, generator=g), torch.randn(b, 4, 5, 5, generator=g)


def test_a_zero_is_euler():
    x, v, eps = _xv()
    for k in range(4):
        for kind in ("sde", "cps"):
            out = flow_step(v, x, SIGMAS[k], SIGMAS[k + 1], float(SIGMAS[1]), 0.0, kind, noise=eps)
            euler = x + v * (SIGMAS[k + 1] - SIGMAS[k])
            if kind == "sde":  # same arithmetic as the scheduler's Euler step: bit-identical
                assert torch.equal(out.prev_sample, euler)
            else:  # CPS reaches Euler through x̂0/x̂1: equal up to rounding
                assert torch.allclose(out.prev_sample, euler, atol=1e-6)
            assert torch.all(out.std == 0)


def test_sde_formula_and_log_prob_match_normal():
    x, v, eps = _xv()
    a = 0.7
    for k in range(3):
        s, sn = SIGMAS[k], SIGMAS[k + 1]
        out = flow_step(v, x, s, sn, float(SIGMAS[1]), a, "sde", noise=eps)
        sig_t = SIGMAS[1] if s >= 1 else s  # σ̃ = sigmas[1] at σ = 1
        s_t = a * math.sqrt(s / (1 - sig_t))
        dt = sn - s
        mu = x * (1 + s_t**2 / (2 * s) * dt) + v * (1 + s_t**2 * (1 - s) / (2 * s)) * dt
        std = s_t * math.sqrt(-dt)
        assert torch.allclose(out.mean, mu, atol=1e-6)
        assert torch.allclose(out.prev_sample, mu + std * eps, atol=1e-6)
        assert torch.isfinite(out.std).all() and torch.allclose(out.std, torch.full((3,), std))
        ref = torch.distributions.Normal(mu, std).log_prob(out.prev_sample).mean(dim=(1, 2, 3))
        assert torch.allclose(out.log_prob, ref, atol=1e-5)


def test_a_grid_starting_just_below_one_takes_sigmas_1_at_its_first_step():
    """Wan's shipped UniPC grid starts at 1 − 1e-6 and SANA's at 1 − 3e-4: their first step takes
    σ̃ = sigmas[1] as a grid starting at 1 does (flow_grpo's rule, read as "σ above sigmas[1]"),
    not 1/(1 − σ) ≈ 1e6 — which made Wan's first SDE step a std of ~700 and its rollouts
    latents of 10⁴ (docs/runs/family_learning_wan). On a grid from 1 nothing changes."""
    x, v, eps = _xv()
    a, s1 = 0.7, 0.9643
    for s0 in (1.0 - 1e-6, 1.0 - 3.3e-4, 1.0):
        out = flow_step(v, x, s0, s1, s1, a, "sde", noise=eps)
        s_t = a * math.sqrt(s0 / (1 - s1))
        dt = s1 - s0
        mu = x * (1 + s_t**2 / (2 * s0) * dt) + v * (1 + s_t**2 * (1 - s0) / (2 * s0)) * dt
        assert torch.allclose(out.mean, mu, atol=1e-5) and torch.allclose(out.std, torch.full((3,), s_t * math.sqrt(-dt)))
        assert out.prev_sample.abs().max() < 10  # x ~ N(0, 1) stays O(1)
    later = flow_step(v, x, 0.9, 0.8, s1, a, "sde", noise=eps)  # σ ≤ sigmas[1]: its own σ
    assert torch.allclose(later.std, torch.full((3,), a * math.sqrt(0.9 / 0.1) * math.sqrt(0.1)), atol=1e-6)


def test_gradient_flows_only_through_mean():
    x, v, eps = _xv()
    v = v.clone().requires_grad_(True)
    x_next = (x + 0.1 * eps).requires_grad_(True)
    out = flow_step(v, x, SIGMAS[1], SIGMAS[2], float(SIGMAS[1]), 0.7, "sde", prev_sample=x_next)
    out.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert x_next.grad is None  # x' is detached inside log π


def test_cps_identities():
    x, v, eps = _xv()
    a = 0.8
    for k in range(3):
        s, sn = SIGMAS[k], SIGMAS[k + 1]
        out = flow_step(v, x, s, sn, float(SIGMAS[1]), a, "cps", noise=eps)
        std = sn * math.sin(a * math.pi / 2)
        assert torch.allclose(out.std, torch.full((3,), float(std)))
        # deterministic x̂1 coefficient² + fresh-noise variance = σ'² (noise coefficients preserved)
        assert math.isclose((sn**2 - std**2) + std**2, float(sn**2), rel_tol=1e-6)
        x0, x1 = x - s * v, x + (1 - s) * v
        mu = (1 - sn) * x0 + math.sqrt(max(0.0, sn**2 - std**2)) * x1
        assert torch.allclose(out.mean, mu, atol=1e-6)
        assert torch.allclose(out.log_prob, -((out.prev_sample - mu) ** 2).mean(dim=(1, 2, 3)), atol=1e-6)


def test_replay_of_drawn_sample_gives_same_log_prob():
    x, v, eps = _xv()
    roll = flow_step(v, x, SIGMAS[1], SIGMAS[2], float(SIGMAS[1]), 0.7, "sde", noise=eps)
    rep = flow_step(v, x, SIGMAS[1], SIGMAS[2], float(SIGMAS[1]), 0.7, "sde", prev_sample=roll.prev_sample)
    assert torch.equal(roll.log_prob, rep.log_prob)


def test_kl_as_flow_grpo():
    mu, ref = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    s_t = torch.tensor([0.5, 0.25])
    kl = kl_to_reference(mu, ref, s_t)
    expect = ((mu - ref) ** 2).mean(dim=(1, 2, 3)) / (2 * s_t**2)
    assert torch.allclose(kl, expect)
    assert torch.all(kl_to_reference(mu, mu, s_t) == 0)
