"""Online Diffusion-DPO: each group's best and worst rollout become a pair (advantages +1/−1),
the loss is Diffusion-DPO's on the pairs whatever their row order, and the online loop trains it
on the policy's own ODE samples through the real flow."""

import json

import lance
import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.online_dpo import best_worst_advantages, pair_order
from pixrl.algorithms.replay import ReplayPolicy
from pixrl.artifacts.batch import RolloutBatch
from pixrl.cli import app
from pixrl.config.loader import load_config
from pixrl.engines.policy import TrainablePolicy


def test_each_group_pairs_its_best_and_worst():
    rewards = np.array([0.2, 0.9, 0.5, 0.9, 0.7, 0.7, 0.7, 0.7, 0.1, 0.3, 0.3, 0.2])
    groups = np.repeat([0, 1, 2], 4)
    got = best_worst_advantages(rewards, groups)
    assert got.advantages.tolist() == [-1, 1, 0, 0, 0, 0, 0, 0, -1, 1, 0, 0]  # ties: the first; a flat group: none
    assert got.zero_std_ratio == pytest.approx(1 / 3) and got.keep.sum() == 4
    assert best_worst_advantages(rewards, groups, min_margin=0.25).advantages.tolist() == [-1, 1] + [0] * 10


def test_the_loss_is_diffusion_dpos_on_the_pairs_in_any_row_order(tiny_checkpoint):
    cfg = load_config(None, [f"model.path={tiny_checkpoint}", "algorithm=online_dpo"])
    pol = TrainablePolicy(cfg)
    fam = pol.family
    g = torch.Generator().manual_seed(0)
    x = torch.randn((4, *fam.latent_shape()), generator=g).numpy()  # rows: loser 0, winner 0, winner 1, loser 1
    prompts = ["a red circle", "a red circle", "two blue squares", "two blue squares"]
    cond = fam.encode_prompts(prompts)

    def run(algorithm, rows, adv):
        policy = ReplayPolicy(fam, pol.reference(), cond.select(rows), None, None, None, None, fam.device,
                              torch.Generator().manual_seed(7), 1000.0)
        batch = RolloutBatch({"final_latent": x[rows], "advantage": np.asarray(adv, np.float32),
                              "group_id": np.asarray([[0, 0, 1, 1][r] for r in rows])})
        (loss, metrics), = list(algorithm.losses(batch, policy))
        return loss, metrics

    online, _ = run(build_algorithm(cfg.algorithm), [0, 1, 2, 3], [-1, 1, 1, -1])
    offline, _ = run(build_algorithm(load_config(None, [f"model.path={tiny_checkpoint}",
                                                        "algorithm=diffusion_dpo"]).algorithm), [1, 2, 0, 3], [0] * 4)
    assert torch.equal(online, offline) and float(online.detach()) == pytest.approx(np.log(2), abs=1e-6)  # at θ = ref: ln 2
    with pytest.raises(ValueError, match="whole \\(best, worst\\) pairs"):
        pair_order(np.array([1.0, -1.0, 1.0]), np.array([0, 0, 1]))


def test_settings_that_cannot_pair_are_refused_before_a_run(tiny_checkpoint, tmp_path):
    for bad, message in ((["sampling.micro_batch=3", "sampling.group_size=3"], "an even number"),
                         (["reward.weights={jpeg_compressibility: 1.0, shapes: 1.0}", "reward.aggregate=advantage"],
                          "set reward.aggregate=reward")):
        res = CliRunner().invoke(app, ["train", "-n", "1", "algorithm=online_dpo", "reward=jpeg_compressibility",
                                       *tiny_overrides(tiny_checkpoint, tmp_path), *bad])
        assert res.exit_code == 2 and message in res.output, res.output


def test_the_online_loop_trains_on_its_own_pairs(tiny_checkpoint, tmp_path, prefect_harness):
    res = CliRunner().invoke(app, ["train", "-n", "2", "--run", "odpo", "algorithm=online_dpo", "algorithm.lr=1e-3",
                                   "reward=jpeg_compressibility", *tiny_overrides(tiny_checkpoint, tmp_path)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    ds = lance.dataset(out["table_uri"])
    t = ds.to_table(columns=["iteration", "group_id", "advantage"])
    for (it, g), adv in t.to_pandas().groupby(["iteration", "group_id"])["advantage"]:
        assert sorted(adv.tolist()) == [-1.0, 0.0, 0.0, 1.0], (it, g)  # distinct JPEG sizes: one pair per group
    assert "final_latent" in ds.schema.names and "log_probs" not in ds.schema.names  # ODE: no transitions stored
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    hist = lambda key: [m.value for m in client.get_metric_history(out["run_id"], key)]  # noqa: E731
    assert hist("samples_trained") == [4.0, 4.0] and hist("loss")[0] == pytest.approx(np.log(2), abs=1e-6)
    assert len(hist("implicit_acc")) == 2 and sorted(int(v.version) for v in
                                                     client.search_model_versions("name='pixrl-policy'")) == [1, 2]
