"""Offline Diffusion-DPO from archived rollouts: the loss against algorithms.md §9, pairing
rules, selection filters, Lance version pinning, and the flow end to end (real Lance, MLflow,
Prefect, a tiny real SD3 model)."""

import json
from pathlib import Path
import math

import lance
import numpy as np
import pyarrow as pa
import pytest
import torch
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.algorithms.diffusion_dpo import dpo_loss, noised, sample_sigmas, velocity_error
from pixrl.algorithms.pairing import make_pairs
from pixrl.artifacts.archive import ArchiveError, resolve_sources, select_rows
from pixrl.artifacts.tracking import Tracker
from pixrl.cli import app
from pixrl.config.loader import load_config
from pixrl.config.schema import DPOConfig
from pixrl.algorithms.pairing import pair_order
from pixrl.stages.offline import pair_scores
from pixrl.engines.policy import TrainablePolicy


# --- loss -----------------------------------------------------------------------------------
def test_dpo_loss_matches_the_formula():
    g = torch.Generator().manual_seed(0)
    ew, el, rw, rl = (torch.rand(6, generator=g) for _ in range(4))
    beta = 37.0
    loss, m = dpo_loss(ew, el, rw, rl, beta)
    inside = -0.5 * beta * ((ew - rw) - (el - rl))
    want = -torch.log(torch.sigmoid(inside)).mean()
    assert torch.allclose(loss, want, atol=1e-6)
    assert m["implicit_acc"] == (inside > 0).float().mean()


def test_noised_sample_and_target_follow_the_flow_convention():
    x0, eps = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    s = torch.tensor([0.0, 0.5, 1.0])
    xt, v = noised(x0, eps, s)
    assert torch.equal(xt[0], x0[0]) and torch.equal(xt[2], eps[2]) and torch.allclose(xt[1], (x0[1] + eps[1]) / 2)
    assert torch.equal(v, eps - x0)
    sig = sample_sigmas(10_000, "logit_normal", torch.Generator().manual_seed(0))
    assert 0 < sig.min() and sig.max() < 1 and abs(float(sig.median()) - 0.5) < 0.02


@pytest.mark.parametrize("scheme,mean,std", [("logit_normal", 0.0, 1.0), ("logit_normal", 0.5, 1.3), ("uniform", 0, 1)])
@pytest.mark.parametrize("within", [(0.6, 0.95), (0.0, 0.3)])
def test_sigmas_within_a_range_are_the_distribution_conditioned_on_it(scheme, mean, std, within):
    """A two-expert checkpoint's DPO draws σ on its expert's side: the same law conditioned on the
    range — its quantiles equal those of rejection sampling from the unrestricted law."""
    drawn = sample_sigmas(200_000, scheme, torch.Generator().manual_seed(1), mean, std, within=within)
    lo, hi = max(within[0], 1e-3), min(within[1], 1 - 1e-3)
    assert lo <= float(drawn.min()) and float(drawn.max()) <= hi
    free = sample_sigmas(2_000_000, scheme, torch.Generator().manual_seed(2), mean, std)
    kept = free[(free >= lo) & (free <= hi)]
    q = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95])
    assert torch.allclose(torch.quantile(drawn, q), torch.quantile(kept[:200_000], q), atol=4e-3)
    with pytest.raises(ValueError, match="no σ to draw"):
        sample_sigmas(4, scheme, torch.Generator(), mean, std, within=(0.9995, 1.0))


def _policy(ckpt, **extra):
    return TrainablePolicy(load_config("shapes_dpo", tiny_overrides(ckpt, "/tmp/unused", **extra)))


def test_loss_is_ln2_at_init_and_a_step_prefers_the_winner(tiny_checkpoint):
    torch.manual_seed(0)
    pol = _policy(tiny_checkpoint, **{"algorithm.lr": 1e-3})
    fam = pol.family
    c, h, w = fam.latent_shape()
    g = torch.Generator().manual_seed(1)
    x_w, x_l, eps = (torch.randn(4, c, h, w, generator=g) for _ in range(3))
    sigma = sample_sigmas(4, "uniform", g)
    cond = fam.encode_prompts(["a red circle"] * 8)
    t = torch.cat([sigma, sigma]) * fam.scheduler.config.num_train_timesteps

    def errors():
        (xw, vw), (xl, vl) = noised(x_w, eps, sigma), noised(x_l, eps, sigma)
        x, v = torch.cat([xw, xl]), torch.cat([vw, vl])
        return velocity_error(fam.velocity(x, t, cond), v), velocity_error(pol.reference_call("velocity", x, t, cond), v)

    err, ref = errors()
    loss, m = dpo_loss(err[:4], err[4:], ref[:4], ref[4:], beta=100.0)
    assert float(loss.detach()) == pytest.approx(math.log(2), abs=1e-6) and float(m["implicit_acc"]) == 0.0
    opt = pol.ensure_optimizer(None)
    loss.backward()
    opt.step()
    with torch.no_grad():
        err, ref = errors()
    # the winner's error fell relative to the reference, more than the loser's: inside > 0
    inside = -0.5 * ((err[:4] - ref[:4]) - (err[4:] - ref[4:]))
    assert float(inside.mean()) > 0


# --- pairing --------------------------------------------------------------------------------
def test_best_vs_worst_one_pair_per_group_ties_dropped():
    keys = ["a", "a", "a", "b", "b", "c", "c"]
    r = np.array([0.2, 0.9, 0.5, 0.4, 0.4, 0.1, 0.3])
    p = make_pairs(keys, r, "best_worst")
    assert list(zip(p.winner, p.loser)) == [(1, 0), (6, 5)]  # group b is tied: no pair
    assert p.groups == 3 and p.groups_without_pair == 1


def test_all_pairs_respect_margin_and_never_cross_groups():
    keys = ["a", "a", "a", "b", "b"]
    r = np.array([0.0, 0.3, 0.35, 1.0, 0.0])
    p = make_pairs(keys, r, "all", margin=0.3)
    pairs = set(zip(p.winner.tolist(), p.loser.tolist()))
    assert pairs == {(1, 0), (2, 0), (3, 4)}  # (2, 1) is below the margin; nothing pairs 3 with a's members
    assert all(keys[w] == keys[l] for w, l in pairs)
    with pytest.raises(ValueError, match="NaN"):
        make_pairs(keys, np.array([0, np.nan, 0, 0, 0]), "all")


def test_pairs_rank_by_a_named_reward_component():
    """pair_on='shapes.correct': exactly-right against wrong, whatever the partial credit says."""
    comp = lambda c, p: [{"name": "shapes.correct", "value": c}, {"name": "shapes.partial", "value": p}]  # noqa: E731
    sel = pa.table({"reward": [0.9, 0.6, 0.7, 0.1],
                    "rewards": [comp(0.0, 0.9), comp(1.0, 0.2), comp(0.0, 0.7), comp(0.0, 0.1)]})
    assert pair_scores(sel, "reward").tolist() == [0.9, 0.6, 0.7, 0.1]
    scores = pair_scores(sel, "shapes.correct")
    p = make_pairs(["g"] * 4, scores, "all", margin=1.0)
    assert sorted(zip(p.winner.tolist(), p.loser.tolist())) == [(1, 0), (1, 2), (1, 3)]
    by_total = make_pairs(["g"] * 4, pair_scores(sel, "reward"), "best_worst")
    assert (by_total.winner.tolist(), by_total.loser.tolist()) == ([0], [3])
    with pytest.raises(ArchiveError, match="dpo.pair_on"):
        pair_scores(sel, "pickscore")


def test_category_balance_gives_each_category_its_share_of_every_step():
    cats = ["colors"] * 90 + ["position"] * 6 + ["counting"] * 4
    rng = np.random.default_rng(0)
    plan = pair_order(cats, steps=20, per_step=6, balance="category", rng=rng)
    for batch in plan:
        assert len(batch) == 6
        assert sorted(cats[i] for i in batch) == ["colors"] * 2 + ["counting"] * 2 + ["position"] * 2
    used = [i for batch in plan for i in batch if cats[i] == "counting"]
    assert set(used) == set(range(96, 100))  # a small category cycles through all its pairs
    flat = pair_order(cats, steps=50, per_step=6, balance="none", rng=np.random.default_rng(0))
    seq = [i for b in flat for i in b]
    assert len(seq) == 300
    for epoch in range(3):  # 'none': consecutive permutations of all pairs
        assert sorted(seq[epoch * 100:(epoch + 1) * 100]) == list(range(100))


# --- an archive to select from ----------------------------------------------------------------
@pytest.fixture(scope="module")
def archive(tiny_checkpoint, tmp_path_factory, prefect_harness):
    wd = tmp_path_factory.mktemp("archive")
    res = CliRunner().invoke(app, ["train", "-n", "2", "--run", "src", "--seed", "5", "reward=jpeg_compressibility",
                                   *tiny_overrides(tiny_checkpoint, wd)])
    assert res.exit_code == 0, res.output
    run_id = json.loads(res.stdout.strip().splitlines()[-1])["run_id"]
    return wd, run_id, Tracker(f"sqlite:///{wd / 'mlflow.db'}")


def test_filters_select_by_iteration_version_reward_and_category(archive):
    wd, run_id, tracker = archive
    (t,) = resolve_sources(["src"], tracker)
    assert t.run_ids == (run_id,) and t.version == lance.dataset(t.uri).version
    everything = select_rows([t], DPOConfig())
    assert everything.num_rows == 16 and set(everything["source"].to_pylist()) == {t.ref}
    assert set(select_rows([t], DPOConfig(iteration_range=(1, 2)))["iteration"].to_pylist()) == {1}
    assert set(select_rows([t], DPOConfig(policy_versions=[0]))["iteration"].to_pylist()) == {0}
    med = float(np.median(everything["reward"].to_numpy()))
    hi = select_rows([t], DPOConfig(reward_min={"reward": med}))
    assert 0 < hi.num_rows < 16 and min(hi["reward"].to_pylist()) >= med
    comp = select_rows([t], DPOConfig(reward_max={"jpeg_compressibility": med}))
    assert max(comp["reward"].to_pylist()) <= med
    cats = {json.loads(m)["category"] for m in everything["prompt_meta"].to_pylist()}
    one = sorted(cats)[0]
    sel = select_rows([t], DPOConfig(categories=[one]))
    assert 0 < sel.num_rows and {json.loads(m)["category"] for m in sel["prompt_meta"].to_pylist()} == {one}
    with pytest.raises(ArchiveError, match="not a reward these rollouts were scored with"):
        select_rows([t], DPOConfig(reward_min={"pickscore": 0.0}))
    with pytest.raises(ArchiveError, match="no run named"):
        resolve_sources(["nope"], tracker)


def test_rows_appended_after_the_pinned_version_are_not_read(archive, tmp_path):
    wd, run_id, tracker = archive
    src = lance.dataset(str(wd / "lance" / "src" / "trajectories.lance"))
    copy_uri = str(tmp_path / "copy.lance")
    lance.write_dataset(src.to_table(), copy_uri)
    (pinned,) = resolve_sources([copy_uri], tracker)
    extra = src.to_table(filter="iteration = 1")
    extra = extra.set_column(extra.schema.get_field_index("iteration"), extra.schema.field("iteration"),
                             pa.array([7] * extra.num_rows, pa.int32()))
    lance.write_dataset(extra, copy_uri, mode="append")
    assert select_rows([pinned], DPOConfig()).num_rows == 16  # time travel: the pinned version
    (later,) = resolve_sources([f"{copy_uri}@{pinned.version + 1}"], tracker)
    assert select_rows([later], DPOConfig()).num_rows == 24


def test_dpo_flow_end_to_end_with_lineage(archive):
    wd, src_run, tracker = archive
    res = CliRunner().invoke(app, ["dpo", "--from", "src", "-n", "3", "--run", "d1", "--workdir", str(wd),
                                   f"model.path={archive_ckpt(wd)}", "dpo.eval_per_category=2",
                                   "dpo.pairs_per_step=4", "sampling.eval_steps=2"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    run = client.get_run(out["run_id"])
    tags = run.data.tags
    assert tags["pixrl.dpo.source_run_ids"] == src_run and tags["pixrl.algorithm"] == "diffusion_dpo"
    (pinned,) = json.loads(tags["pixrl.dpo.sources"])
    assert pinned["version"] == lance.dataset(pinned["uri"]).version and pinned["run_ids"] == [src_run]
    loss = client.get_metric_history(out["run_id"], "dpo/loss")
    assert sorted(m.step for m in loss) == [0, 1, 2]
    assert min(loss, key=lambda m: m.step).value == pytest.approx(math.log(2), abs=1e-6)
    assert run.data.metrics["pairs"] == lance.dataset(str(wd / "lance" / "d1" / out["run_id"] / "pairs.lance")).count_rows() > 0
    assert "heldout/accuracy" in run.data.metrics and "heldout/accuracy_before" in run.data.metrics
    # the DPO version joins the experiment's registered model beside the source run's versions,
    # takes `rollout`, and (its held-out accuracy tagged) `champion`, since nothing else was evaluated
    assert out["model_name"] == "pixrl-policy"
    dpo_version = client.get_model_version_by_alias("pixrl-policy", "rollout")
    assert dpo_version.run_id == out["run_id"] and int(dpo_version.version) == out["policy"]["version"]
    assert {v.run_id for v in client.search_model_versions("name='pixrl-policy'")} == {src_run, out["run_id"]}
    assert float(dpo_version.tags["heldout_accuracy"]) == run.data.metrics["heldout/accuracy"]
    assert client.get_model_version_by_alias("pixrl-policy", "champion").version == dpo_version.version
    assert run.info.status == "FINISHED"


def archive_ckpt(wd):
    cfg = Tracker(f"sqlite:///{wd / 'mlflow.db'}")
    rid = cfg.find_run("pixrl.run_name", "src")
    return cfg.read_config(rid)["model"]["path"]


def test_dpo_fails_before_writing_when_nothing_pairs(archive):
    wd, _, tracker = archive
    n_runs = len(tracker.client.search_runs([e.experiment_id for e in tracker.client.search_experiments()]))
    res = CliRunner().invoke(app, ["dpo", "--from", "src", "--run", "d2", "--workdir", str(wd),
                                   "--reward-min", "reward=1e9", f"model.path={archive_ckpt(wd)}"])
    assert res.exit_code == 2 and "select no scored rollouts" in res.output
    res = CliRunner().invoke(app, ["dpo", "--from", "src", "--run", "d3", "--workdir", str(wd), "--margin", "1e9",
                                   f"model.path={archive_ckpt(wd)}"])
    assert res.exit_code == 2 and "no preference pairs" in res.output
    assert len(tracker.client.search_runs([e.experiment_id for e in tracker.client.search_experiments()])) == n_runs


def test_rollouts_archive_a_fixed_policy_that_dpo_then_trains_on(tiny_checkpoint, tmp_path, prefect_harness):
    wd = tmp_path / "base-archive"
    bad = CliRunner().invoke(app, ["rollouts", "-n", "2", "--run", "nope", "--policy-version", "3", "reward=jpeg_compressibility",
                                   *tiny_overrides(tiny_checkpoint, wd)])
    assert bad.exit_code == 2 and "pixrl-policy/3 is not registered" in bad.output
    assert not (wd / "lance").exists()  # refused before a run or a table was written
    res = CliRunner().invoke(app, ["rollouts", "-n", "2", "--run", "base", "reward=jpeg_compressibility",
                                   *tiny_overrides(tiny_checkpoint, wd)])
    assert res.exit_code == 0, res.output
    assert "it   1 | generate" in res.output and "reward=" in res.output  # one progress line per iteration
    out = json.loads(res.stdout.strip().splitlines()[-1])
    rows = lance.dataset(out["table_uri"]).to_table()
    assert rows.num_rows == 2 * 2 * 4  # iterations × prompts × group
    assert set(rows["policy_version"].to_pylist()) == {0} and set(rows["iteration"].to_pylist()) == {0, 1}
    assert rows["image"].null_count == 0 and rows["reward"].null_count == 0
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["pixrl.mode"] == "rollouts"
    assert client.search_model_versions("name='pixrl-policy'") == []  # nothing trained, nothing published
    assert not (wd / "checkpoints").exists()
    res = CliRunner().invoke(app, ["dpo", "--from", "base", "-n", "2", "--run", "dpo-base", "--workdir", str(wd),
                                   f"model.path={tiny_checkpoint}", "dpo.eval_per_category=1",
                                   "dpo.pairs_per_step=2", "sampling.eval_steps=2"])
    assert res.exit_code == 0, res.output
    dpo_run = client.get_run(json.loads(res.stdout.strip().splitlines()[-1])["run_id"])
    assert dpo_run.data.tags["pixrl.dpo.source_run_ids"] == out["run_id"] and dpo_run.data.metrics["pairs"] > 0


# --- SFT on the winners (Diffusion-DPO's --sft baseline) --------------------------------------
def test_sft_loss_is_the_flow_matching_error_of_the_winners_alone(tiny_checkpoint):
    """L = mean ‖(ε − x0_w) − v_θ(x_σ, σ, c)‖² with σ drawn as DPO draws it (logit-normal, then the
    scheduler's shift 3) and ε drawn after it, from the update's generator; the losers do not enter."""
    from pixrl.algorithms.base import build_algorithm
    from pixrl.algorithms.diffusion_dpo import NoiseLevelSettings, draw_noise_levels
    from pixrl.algorithms.ode_solvers import shifted
    from pixrl.algorithms.replay import ReplayPolicy
    from pixrl.artifacts.batch import RolloutBatch

    cfg = load_config("shapes_sft", tiny_overrides(tiny_checkpoint, "/tmp/unused"))
    assert cfg.algorithm.name == "diffusion_sft"
    pol = TrainablePolicy(cfg)
    fam, algo = pol.family, build_algorithm(cfg.algorithm)
    assert not algo.needs_reference and algo.offline
    shape = fam.latent_shape()
    g = torch.Generator().manual_seed(1)
    x_w, x_l = torch.randn(3, *shape, generator=g), torch.randn(3, *shape, generator=g)
    prompts = ["a red circle", "a blue square", "two green triangles"]
    cond = fam.encode_prompts(prompts * 2)

    def loss_of(losers):
        batch = RolloutBatch({"final_latent": torch.cat([x_w, losers]).numpy()})
        policy = ReplayPolicy(fam, None, cond, None, None, None, None, fam.device, torch.Generator().manual_seed(7))
        (loss, m), = list(algo.losses(batch, policy))
        return loss, m

    loss, m = loss_of(x_l)
    gen = torch.Generator().manual_seed(7)
    sigma = shifted(sample_sigmas(3, "logit_normal", gen), 3.0)
    eps = torch.randn(x_w.shape, generator=gen)
    with torch.no_grad():
        v = fam.velocity((1 - sigma.view(-1, 1, 1, 1)) * x_w + sigma.view(-1, 1, 1, 1) * eps, sigma * 1000,
                         cond.select([0, 1, 2]))
    want = ((v - (eps - x_w)) ** 2).mean()
    assert torch.allclose(loss.detach(), want, rtol=1e-6) and loss.requires_grad
    assert float(m["err_w"]) == pytest.approx(float(want), rel=1e-6)
    assert torch.equal(loss_of(torch.randn(3, *shape, generator=g))[0].detach(), loss.detach())  # losers ignored
    policy = ReplayPolicy(fam, None, cond, None, None, None, None, fam.device, torch.Generator().manual_seed(7))
    assert torch.equal(draw_noise_levels(3, NoiseLevelSettings(), policy), sigma)  # DPO's law, shared


def test_sft_flow_trains_on_the_best_rollouts_and_publishes(archive):
    wd, src_run, _ = archive
    res = CliRunner().invoke(app, ["sft", "--from", "src", "-n", "3", "--run", "sft1",
                                   "--workdir", str(wd), f"model.path={archive_ckpt(wd)}", "dpo.eval_per_category=2",
                                   "dpo.pairs_per_step=4", "sampling.eval_steps=2", "algorithm.lr=1e-3",
                                   "algorithm.ema.enabled=true", "algorithm.ema.every=1"])
    assert res.exit_code == 0, res.output
    assert "pixrl sft sft1 (diffusion_sft)" in " ".join(res.output.split())
    out = json.loads(res.stdout.strip().splitlines()[-1])
    client = MlflowClient(f"sqlite:///{wd / 'mlflow.db'}")
    run = client.get_run(out["run_id"])
    assert run.data.tags["pixrl.algorithm"] == "diffusion_sft" and run.info.status == "FINISHED"
    loss = client.get_metric_history(out["run_id"], "dpo/loss")
    assert sorted(m.step for m in loss) == [0, 1, 2] and all(m.value > 0 for m in loss)
    assert "heldout/accuracy" in run.data.metrics
    from safetensors.torch import load_file

    source = out["policy"]["source"].removeprefix("file://")
    trained = load_file(f"{source}/trainable.safetensors")
    base = load_file(f"{archive_ckpt(wd)}/transformer/diffusion_pytorch_model.safetensors")
    assert any(not torch.equal(trained[k], base[k]) for k in base)
    from pixrl.artifacts.checkpoints import load_ema  # offline training keeps the weight average too

    average, steps = load_ema(Path(source))
    assert steps == 3 and set(average) == set(trained) and any(not torch.equal(average[k], trained[k]) for k in base)
