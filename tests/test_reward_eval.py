"""Held-out evaluation by the run's rewards, for prompt sets without an evaluator of their own:
fixed (prompt, seed) pairs per category, the mean total reward per category and over categories,
through the online loop (`run.eval_every` on a text prompt file with held-out prompts: held-out
curves and the champion alias) and for an editing set (each sample edits its own source)."""

import json

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.algorithms.recipe import eval_recipe
from pixrl.cli import app
from pixrl.config.loader import load_config
from pixrl.datasets.prompts import PromptItem, load_prompt_set
from pixrl.datasets.reward_eval import EVAL_SEED, reward_eval_pairs, reward_evaluation
from pixrl.datasets.shapes.evaluate import generate_images
from pixrl.engines.policy import TrainablePolicy
from pixrl.rewards.compose import RewardSet


def test_pairs_are_fixed_per_category_and_cycle_the_prompts():
    items = [PromptItem("a", "x", {"category": "b"}), PromptItem("b", "y", {}), PromptItem("c", "z", {"category": "b"})]
    pairs = reward_eval_pairs(items, 3)
    assert [(it.prompt_id, s) for it, s in pairs] == [
        ("b", EVAL_SEED * 1000), ("b", EVAL_SEED * 1000 + 1), ("b", EVAL_SEED * 1000 + 2),
        ("a", EVAL_SEED * 1000 + 100_000), ("c", EVAL_SEED * 1000 + 100_001), ("a", EVAL_SEED * 1000 + 100_002)]
    assert reward_eval_pairs(items, 3) == pairs


def test_the_score_is_the_rewards_of_the_eval_sampler_s_images(tiny_checkpoint, tmp_path):
    cfg = load_config(None, [*tiny_overrides(tiny_checkpoint, tmp_path), "reward=jpeg_compressibility"])
    family = TrainablePolicy(cfg).family
    items = [PromptItem("p0", "a red circle", {"category": "one"}), PromptItem("p1", "two blue squares", {"category": "two"}),
             PromptItem("p2", "a green star", {"category": "two"})]
    rewards = RewardSet({"jpeg_compressibility": 1.0})
    res = reward_evaluation(family, items, cfg.sampling, 2, rewards)
    pairs = reward_eval_pairs(items, 2)
    imgs = generate_images(family, [it.prompt for it, _ in pairs], [s for _, s in pairs],
                           eval_recipe(cfg.sampling, "denoise"))
    r = rewards.score(imgs, [it.prompt for it, _ in pairs], [{}] * 4, list("abcd"))["reward"]
    assert res["n"] == 4 and res["metric"] == "reward"
    assert res["category/one"] == pytest.approx(float(np.mean(r[:2]))) and res["category/two"] == pytest.approx(float(np.mean(r[2:])))
    assert res["accuracy"] == pytest.approx((res["category/one"] + res["category/two"]) / 2)
    assert res["reward/jpeg_compressibility"] == pytest.approx(float(np.mean(r)))


def test_the_online_loop_evaluates_a_text_prompt_file_with_its_rewards(tiny_checkpoint, tmp_path, prefect_harness):
    train, heldout = tmp_path / "train.txt", tmp_path / "heldout.txt"
    train.write_text("a red circle\ntwo blue squares\na green triangle\n")
    heldout.write_text("a yellow star\nthree white circles\n")
    res = CliRunner().invoke(app, ["train", "-n", "2", "--run", "txt", "reward=jpeg_compressibility",
                                   *tiny_overrides(tiny_checkpoint, tmp_path), "dataset=text_prompts",
                                   f"dataset.path={train}", f"dataset.heldout_path={heldout}", "dataset.categories=null",
                                   "run.eval_every=1",
                                   "run.eval_per_category=2"])
    assert res.exit_code == 0, res.output
    run_id = json.loads(res.stdout.strip().splitlines()[-1])["run_id"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(run_id, "heldout/accuracy")
    assert sorted(m.step for m in history) == [0, 1, 2] and all(-3 < m.value < 0 for m in history)
    assert client.get_model_version_by_alias("pixrl-policy", "champion") is not None
    ev = CliRunner().invoke(app, ["eval", "--run", "txt", "--workdir", str(tmp_path), "--per-category", "2", "--json"])
    assert ev.exit_code == 0 and "reward eval" in ev.output, ev.output
    got = json.loads(ev.stdout.strip().splitlines()[-1])
    assert got["metric"] == "reward" and got["accuracy"] == pytest.approx(max(history, key=lambda m: m.step).value)


def test_an_editing_set_is_evaluated_on_its_own_sources(tiny_flux_kontext, tmp_path):
    path, overrides = tiny_flux_kontext
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()] + [f"run.workdir={tmp_path}",
                                                                          "reward=jpeg_compressibility"])
    family = TrainablePolicy(cfg).family
    items = load_prompt_set(path / "edits" / "edits.jsonl")
    res = reward_evaluation(family, items, cfg.sampling, 4, RewardSet({"jpeg_compressibility": 1.0}))
    swapped = [PromptItem(it.prompt_id, it.prompt, it.meta, items[0].image) for it in items]
    other = reward_evaluation(family, swapped, cfg.sampling, 4, RewardSet({"jpeg_compressibility": 1.0}))
    assert res["n"] == 4 and res["accuracy"] != other["accuracy"]  # each edit conditioned on its own source
