"""Group advantages (§2.5) and PPO-clip (§2.6, §17.6) against the reference formulas."""

import numpy as np
import pytest
import torch

from pixrl.algorithms.advantages import group_advantages
from pixrl.algorithms.losses import ppo_clip_loss


def test_global_std_advantages():
    r = np.array([1.0, 2.0, 3.0, 5.0, 5.0, 5.0], np.float32)
    g = np.array([0, 0, 0, 1, 1, 1])
    out = group_advantages(r, g, global_std=True, eps=1e-4, clip=5.0)
    std = np.std(r) + 1e-4
    expect = np.concatenate([(r[:3] - 2.0) / std, np.zeros(3)])
    np.testing.assert_allclose(out.advantages, expect, rtol=1e-6)
    assert out.zero_std_ratio == 0.5
    assert out.keep.tolist() == [True, False, True, False, False, False]


def test_per_group_std_and_clip():
    r = np.array([0.0, 0.0, 0.0, 1.0, 10.0, 10.0, 10.0, 10.0], np.float32)
    g = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    out = group_advantages(r, g, global_std=False, eps=1e-4, clip=1.5)
    grp = r[:4]
    raw = (grp - grp.mean()) / (np.std(grp) + 1e-4)
    np.testing.assert_allclose(out.advantages[:4], np.clip(raw, -1.5, 1.5), rtol=1e-6)
    assert out.advantages[3] == pytest.approx(1.5)


def test_nan_rewards_are_rejected():
    with pytest.raises(ValueError):
        group_advantages(np.array([1.0, np.nan]), np.array([0, 0]))


def test_ppo_clip_values_and_zero_gradient_where_clipped():
    eps = 0.1
    old = torch.zeros(4)
    # ratios: 1.5 (A>0, clipped), 0.5 (A<0, clipped), 1.05 (A>0, inside), 0.5 (A>0: unclipped branch is max)
    lp = torch.log(torch.tensor([1.5, 0.5, 1.05, 0.5])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0])
    loss, m = ppo_clip_loss(lp, old, adv, clip_range=eps)
    ratio = torch.exp(lp.detach())
    per = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps, 1 + eps))
    assert torch.allclose(loss, per.mean())
    loss.backward()
    assert lp.grad[0] == 0 and lp.grad[1] == 0  # clipped: no gradient
    assert lp.grad[2] != 0 and lp.grad[3] != 0
    assert m["clipfrac"] == pytest.approx(0.75)
    assert m["ratio_max"] == pytest.approx(1.5)


def test_adv_clip_applies_in_loss():
    lp = torch.zeros(1, requires_grad=True)
    loss, _ = ppo_clip_loss(lp, torch.zeros(1), torch.tensor([50.0]), clip_range=1e-4, adv_clip_max=5.0)
    assert loss.item() == pytest.approx(-5.0)


def test_advantage_aggregation_normalises_each_reward_in_its_group():
    """MixGRPO's advantage_aggr: A = Σ w_k·A_k, each A_k from its own reward's group statistics."""
    from functools import partial

    from pixrl.algorithms.advantages import aggregated_advantages

    groups = np.array([0, 0, 1, 1, 2, 2])
    a = np.array([1.0, 0.0, 0.5, 0.5, 0.2, 0.2])  # groups 1 and 2 flat in a
    b = np.array([10.0, 30.0, 0.0, 100.0, 7.0, 7.0])  # a wide reward; group 2 flat in both
    est = partial(group_advantages, global_std=False, eps=1e-12)
    out = aggregated_advantages(est, {"a": a, "b": b}, {"a": 1.0, "b": 0.5}, groups)
    # per group, per reward: (r − mean)/std with std the population std over 2 samples = half the gap
    want = np.array([1.0 + 0.5 * -1.0, -1.0 + 0.5 * 1.0, 0.0 + 0.5 * -1.0, 0.0 + 0.5 * 1.0, 0.0, 0.0])
    assert np.allclose(out.advantages, want) and out.zero_std_ratio == pytest.approx(1 / 3)
    assert out.keep.tolist() == [True] * 4 + [False] * 2
    summed_first = est(a + 0.5 * b, groups).advantages  # reward_aggr: the wide reward decides alone
    assert np.allclose(summed_first, [-1, 1, -1, 1, 0, 0])
    with pytest.raises(ValueError, match=r"\['c'\] are not stored"):
        aggregated_advantages(est, {"a": a}, {"a": 1.0, "c": 1.0}, groups)


def test_a_run_with_aggregated_advantages_stores_them(tmp_path, prefect_harness):
    import json

    import lance
    from typer.testing import CliRunner

    from pixrl.algorithms.advantages import aggregated_advantages
    from pixrl.algorithms.base import build_algorithm
    from pixrl.cli import app
    from pixrl.config.schema import AlgorithmConfig

    weights = {"shapes": 1.0, "jpeg_compressibility": 0.1}
    res = CliRunner().invoke(app, ["train", "--iterations", "1", "--run", "agg", "--workdir", str(tmp_path),
                                   "reward.weights={shapes: 1.0, jpeg_compressibility: 0.1}", "reward.aggregate=advantage",
                                   "sampling.group_size=4", "sampling.prompts_per_iteration=2", "sampling.micro_batch=8",
                                   "run.eval_every=0"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    t = lance.dataset(out["table_uri"]).to_table(columns=["sample_id", "group_id", "rewards", "advantage"]).sort_by("sample_id")
    comps = [{c["name"]: c["value"] for c in row} for row in t["rewards"].to_pylist()]
    components = {k: np.array([c[k] for c in comps]) for k in weights}
    algo = build_algorithm(AlgorithmConfig(name="flow_grpo"))
    want = aggregated_advantages(algo.advantages, components, weights, t["group_id"].to_numpy()).advantages
    assert np.array_equal(t["advantage"].to_numpy(), want)
