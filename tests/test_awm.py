"""AWM (Advantage Weighted Matching) on the tiny SD3 checkpoint: the log-likelihood weightings and
the noise-level draws are AWM's (advantage_weighted_matching's train script, written out here); a
loss term equals AWM's operations written out — the interpolated latent, the matching loss as
log p, the PPO-clipped ratio to the sampling policy, the KL to the base and to the EMA anchor —
value and gradient, at the update's first optimizer step (ρ = 1) and after it (ρ to the update's
starting weights); the anchor follows its EMA after each update and the rollouts of an off-policy
run sample with it, through the real flow; misuse is refused before a run."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import perturbed_sd3, tiny_overrides
from pixrl.algorithms.awm import AWMSettings, draw_levels, ema_decay, matching_log_prob
from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.replay import ReplayPolicy
from pixrl.algorithms.sampling import SamplerRecipe, generators, sample
from pixrl.cli import app
from pixrl.config.schema import AlgorithmConfig
from pixrl.models.sd3 import SD3Family

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


def _awm_log_prob(v, target, t, weighting, power=0.25):
    """compute_log_prob_awm's weighting, as AWM's script writes it (t: [B])."""
    log_prob = -(v.double() - target.double()) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    t = t.view(-1).double()
    if weighting == "t":
        return log_prob * t
    if weighting == "t2":
        return log_prob * t ** 2
    if weighting == "huber":
        return -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    if weighting == "ghuber":
        e = torch.tensor(1e-10, dtype=log_prob.dtype)
        return -(torch.pow(-log_prob + 1e-10, power) - torch.pow(e, power)) * t / power
    return log_prob


@pytest.mark.parametrize("weighting", ["uniform", "t", "t2", "huber", "ghuber"])
def test_the_log_likelihood_is_awms_weighted_matching_loss(weighting):
    g = torch.Generator().manual_seed(0)
    v, target = torch.randn(4, 3, 5, 5, generator=g), torch.randn(4, 3, 5, 5, generator=g)
    t = torch.rand(4, generator=g)
    got = matching_log_prob(v, target, t, weighting, 0.5 if weighting == "ghuber" else 0.25)
    want = _awm_log_prob(v, target, t, weighting, 0.5 if weighting == "ghuber" else 0.25)
    assert got.dtype == torch.float64 and torch.equal(got, want)
    assert torch.all(got <= 0)


def _strata(first: int, top: int, n: int) -> list[tuple[int, int]]:
    bounds = [int(b) for b in torch.linspace(first, top, n + 1).long()]
    return list(zip(bounds[:-1], bounds[1:]))


@pytest.mark.parametrize("time_type,first,strata,init", [
    ("discrete_wo_init", 1, 6, False), ("discrete", 0, 6, False), ("discrete_with_init", 1, 5, True)])
def test_discrete_levels_are_awms_strata_of_the_grid(time_type, first, strata, init):
    """AWM's SD3 settings: 14 rollout steps, 6 levels, fraction 0.9 → the grid's indices below 12,
    one per stratum of linspace(first, 12, ·).long(), one index per term for the whole batch."""
    s = AWMSettings(time_type=time_type, train_timesteps=6, timestep_fraction=0.9)
    want = _strata(first, 12, strata)
    assert want[0][0] == first and want[-1][1] == 12
    seen = [set() for _ in want]
    gen = torch.Generator().manual_seed(3)
    for _ in range(300):
        idx, on_grid = draw_levels(s, 14, 5, gen)
        assert on_grid and idx.shape == (6, 5) and torch.all(idx == idx[:, :1])
        terms = idx[:, 0].tolist()
        if init:
            assert terms[0] == 0
            terms = terms[1:]
        for j, (k, (lo, hi)) in enumerate(zip(terms, want)):
            assert (lo <= k < hi) or (lo == hi == k)
            seen[j].add(k)
    assert all(s == set(range(lo, hi)) or lo == hi for s, (lo, hi) in zip(seen, want))


def test_continuous_levels_are_stratified_and_shifted():
    gen = torch.Generator().manual_seed(4)
    shift, n = 3.0, 6
    unshift = lambda t: t / (shift - (shift - 1) * t)  # noqa: E731
    uni = AWMSettings(time_type="uniform", train_timesteps=n, time_shift=shift)
    for _ in range(50):
        t, on_grid = draw_levels(uni, 10, 4, gen)
        assert not on_grid and t.shape == (n, 4)
        u = unshift(t.double())  # each column: one draw per stratum of [0.2, 1], in a shuffled order
        cells = torch.floor((u - 0.2) / 0.8 * n).long()
        assert all(sorted(cells[:, b].tolist()) == list(range(n)) for b in range(4))
    ln = AWMSettings(time_type="logit_normal", train_timesteps=n, time_shift=shift)
    normal = torch.distributions.Normal(0.0, 1.0)
    for _ in range(50):
        t, _ = draw_levels(ln, 10, 4, gen)
        assert torch.all(t == t[:, :1]) and torch.all(t >= 0.01)
        z = torch.logit(unshift(t[:, 0].double()))
        assert sorted(torch.floor(normal.cdf(z) * n).long().tolist()) == list(range(n))


@pytest.fixture(scope="module")
def family(tiny_checkpoint):
    return SD3Family.load(tiny_checkpoint, max_sequence_length=0)


@pytest.fixture(scope="module")
def moved(tiny_checkpoint):
    """Frozen copies of the tiny SD3 with other weights: the base (KL), the EMA anchor, the update's start."""
    return perturbed_sd3(tiny_checkpoint, [10, 11, 12])


def _reference_loss(fam, views, x0, adv, cond, t, timestep, noise, s, old):
    """AWM's training step for one level, written out: x_t, the matching log p, ρ to `old`,
    max(−A·ρ, −A·clip(ρ)) averaged, + β·KL to the base + ema_beta·KL to the anchor."""
    base, anchor = views
    tb = t.view(-1, 1, 1, 1)
    noised = (1 - tb) * x0 + tb * noise
    target = noise - x0
    v = fam.velocity(noised, timestep, cond, 1.0, None)
    log_prob = _awm_log_prob(v, target, t, "ghuber")
    with torch.no_grad():
        old_log_prob = log_prob if old is None else _awm_log_prob(old.velocity(noised, timestep, cond, 1.0, None),
                                                                 target, t, "ghuber")
        v_ref = base.velocity(noised, timestep, cond, 1.0, None)
        v_ema = anchor.velocity(noised, timestep, cond, 1.0, None)
    a = torch.clamp(adv, -s.adv_clip_max, s.adv_clip_max) / s.adv_clip_max * s.advantage_max
    ratio = torch.exp(log_prob - old_log_prob.detach())
    policy = torch.mean(torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - s.clip_range, 1 + s.clip_range)))
    kl = ((v - v_ref) ** 2).mean(dim=(1, 2, 3)).mean()
    ema = ((v - v_ema) ** 2).mean(dim=(1, 2, 3)).mean()
    return policy + s.kl_weight * kl + s.ema_kl_weight * ema, ratio


@pytest.mark.parametrize("after_a_step", [False, True])
def test_a_loss_term_is_awms_step_value_and_gradient(family, moved, after_a_step):
    algo = build_algorithm(AlgorithmConfig(name="awm", optimizer_steps_per_iteration=2, train_timesteps=2,
                                           clip_range=0.05, kl_weight=0.01, ema_kl_weight=0.5))
    assert algo.frozen_slots() == ("start", "anchor")
    base, anchor, start = moved
    cond = family.encode_prompts(PROMPTS)
    grid = SamplerRecipe(4, 0.0, train_steps=())
    x0 = sample(family, cond, None, generators([1, 2, 3]), grid).final
    sigmas, timesteps = family.schedule(4)
    adv = torch.tensor([6.0, -1.5, 0.4])  # the first beyond the clip at 5
    batch = {"final_latent": x0.numpy(), "advantage": adv.numpy()}
    policy = ReplayPolicy(family, base, cond, None, sigmas, timesteps, grid, torch.device("cpu"),
                          torch.Generator().manual_seed(11), frozen={"start": start, "anchor": anchor})
    algo.prepare_update(batch)
    if after_a_step:
        algo.after_optimizer_step({})
    params = [p for p in family.transformer.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(11)
    idx, _ = draw_levels(algo.settings, 4, 3, gen)
    for j, (loss, metrics) in enumerate(algo.losses(batch, policy)):
        family.transformer.zero_grad()
        loss.backward()
        grads = [p.grad.clone() for p in params]
        k = idx[j]
        noise = torch.randn(x0.shape, generator=gen)
        want, ratio = _reference_loss(family, (base, anchor), x0, adv, cond, sigmas[k].float(), timesteps[k], noise,
                                      algo.settings, start if after_a_step else None)
        family.transformer.zero_grad()
        want.backward()
        assert abs(float(loss) - float(want)) < 1e-6
        assert all(torch.allclose(g, p.grad, atol=1e-8, rtol=1e-4) for g, p in zip(grads, params))
        assert any(float(g.abs().max()) > 0 for g in grads)
        if after_a_step:  # a ratio to the update's starting weights, some of it clipped
            assert float((ratio - 1).abs().max()) > 1e-4 and float(metrics["ratio_max"]) == pytest.approx(
                float(ratio.max()))
        else:
            assert float(metrics["ratio_max"]) == float(metrics["ratio_min"]) == 1.0
    assert j + 1 == algo.terms(batch) == 2
    family.transformer.zero_grad()


def test_the_anchor_follows_its_ema_after_each_update():
    algo = build_algorithm(AlgorithmConfig(name="awm", ema_kl_decay=0.3))
    start = {"w": torch.tensor([1.0, 2.0])}
    assert algo.frozen_weights("anchor", start) is algo.sampling_weights()  # the first update's weights
    assert torch.equal(algo.sampling_weights()["w"], start["w"])
    new = {"w": torch.tensor([3.0, 0.0])}
    got = algo.end_of_update(new, 2)
    assert got["awm/ema_decay"] == pytest.approx(0.002)
    assert torch.allclose(algo.state()["ema"]["w"], 0.002 * start["w"] + 0.998 * new["w"])
    assert [ema_decay(s, 0.3, "linear") for s in (0, 100, 300, 1000)] == pytest.approx([0, 0.1, 0.3, 0.3])
    assert ema_decay(5, 0.3, "constant") == 0.3
    other = build_algorithm(AlgorithmConfig(name="awm"))
    other.load_state(algo.state())
    assert other.state()["step"] == 2 and torch.equal(other.state()["ema"]["w"], algo.state()["ema"]["w"])
    plain = build_algorithm(AlgorithmConfig(name="awm", ema_kl_weight=0.0, optimizer_steps_per_iteration=1))
    assert plain.frozen_slots() == () and plain.end_of_update(new, 1) == {}  # no anchor kept
    off = build_algorithm(AlgorithmConfig(name="awm", off_policy=True))
    assert off.separate_sampler and off.frozen_slots() == ()  # the sampler is the anchor


def _train(tiny_checkpoint, wd, run, *extra):
    args = tiny_overrides(tiny_checkpoint, wd, **{"sampling.window_size": "null", "sampling.window_range": "null"})
    return CliRunner().invoke(app, ["train", "--iterations", "2", "--run", run, "--config", "shapes_awm",
                                    "reward=jpeg_compressibility", *args, "algorithm.lora.enabled=true",
                                    "algorithm.lora.rank=4", "algorithm.lora.alpha=8", "algorithm.lr=1e-3", *extra])


def test_an_off_policy_run_samples_with_the_anchor_and_moves_it(tiny_checkpoint, tmp_path, prefect_harness):
    """Two iterations of two optimizer steps each, LoRA: the anchor after each update is
    d·anchor + (1 − d)·θ (d = 0.001·steps), starting from the base adapter; ρ departs from 1 at
    the second optimizer step of an on-policy run, not at its first."""
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    from pixrl.artifacts.checkpoints import load_optimizer_state
    from pixrl.engines.policy import ALGORITHM_STATE

    res = _train(tiny_checkpoint, tmp_path, "offp", "algorithm.off_policy=true", "algorithm.optimizer_steps_per_iteration=2")
    assert res.exit_code == 0, res.output + repr(res.exception)
    cks = sorted((tmp_path / "checkpoints" / "offp").glob("*/it_000*"))
    assert [c.name for c in cks] == ["it_0000", "it_0001"]
    theta = [load_file(str(c / "trainable.safetensors")) for c in cks]
    emas = [load_optimizer_state(c)[ALGORITHM_STATE]["ema"] for c in cks]
    lora_b = [k for k in theta[0] if "lora_B" in k]
    assert lora_b and any(float(theta[1][k].abs().max()) > 0 for k in lora_b)  # the adapter moved
    for k in theta[0]:
        base = torch.zeros_like(theta[0][k]) if "lora_B" in k else None
        if base is not None:  # PEFT starts B at 0: the anchor starts at the base adapter
            assert torch.allclose(emas[0][k], 0.002 * base + 0.998 * theta[0][k], atol=1e-7)
        assert torch.allclose(emas[1][k], 0.004 * emas[0][k] + 0.996 * theta[1][k], atol=1e-7)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    m = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(out["run_id"]).data.metrics
    assert m["awm/ema_decay"] == pytest.approx(0.004) and "ema_kl" in m and "kl" in m

    on = _train(tiny_checkpoint, tmp_path / "on", "onp", "algorithm.optimizer_steps_per_iteration=2")
    assert on.exit_code == 0, on.output + repr(on.exception)
    out = json.loads(on.stdout.strip().splitlines()[-1])
    client = MlflowClient(f"sqlite:///{tmp_path / 'on' / 'mlflow.db'}")
    m = client.get_run(out["run_id"]).data.metrics
    assert m["onpolicy_ratio_dev"] == 0 and (m["ratio_max"] > 1 or m["ratio_min"] < 1)
    lo = [x.value for x in client.get_metric_history(out["run_id"], "ratio_min")]
    assert lo and min(lo) < 1


def test_misuse_is_refused_before_a_run(tiny_checkpoint, tmp_path):
    from pixrl.config.loader import ConfigError

    algo = build_algorithm(AlgorithmConfig(name="awm"))
    with pytest.raises(ValueError, match="flow-matching"):
        algo.check_sampling(None, "token")
    with pytest.raises(ConfigError, match="did you mean 'algorithm.clip_range'"):
        build_algorithm(AlgorithmConfig(name="awm", clip_rang=0.1))
    res = _train(tiny_checkpoint, tmp_path, "bad", "sampling.max_rounds=2")
    assert res.exit_code != 0 and "sampling.max_rounds=1" in res.output
    assert not (tmp_path / "lance").exists()
