"""Per-task rewards (reward.tasks, rewards/routing.py): each prompt scored by its own task's
rewards and weights, the others by reward.weights; a sample stores only its task's scores."""

import io
import json

import numpy as np
import pytest
from PIL import Image

from pixrl.artifacts.trajectories import rewards_column
from pixrl.config.schema import RewardConfig
from pixrl.datasets.shapes.prompts import parse
from pixrl.datasets.shapes.render import render_prompt
from pixrl.rewards.base import ScoringError, build_reward
from pixrl.rewards.compose import RewardSet
from pixrl.rewards.routing import merge_parts

from conftest import train_args

SHAPES = ["a red circle", "two blue squares", "a green triangle"]


def _batch():
    """Three shapes prompts (categories single, counting, and one without a category) and two free
    prompts with no shapes metadata, which the shapes reward cannot score."""
    metas = [{**parse(SHAPES[0]), "category": "single"}, {**parse(SHAPES[1]), "category": "counting"},
             {k: v for k, v in parse(SHAPES[2]).items() if k != "category"}, {"category": "free"}, {"category": "free"}]
    rng = np.random.default_rng(0)
    images = np.stack([render_prompt(m, i) for i, m in enumerate(metas[:3])]
                      + [rng.integers(0, 255, (32, 32, 3), dtype=np.uint8) for _ in range(2)])
    prompts = SHAPES + ["a photo of a cat", "a bowl of fruit"]
    return images, prompts, metas, [f"s{i}" for i in range(5)]


def test_each_sample_is_scored_by_its_tasks_rewards_with_its_tasks_weights():
    images, prompts, metas, sids = _batch()
    rs = RewardSet({"shapes": 1.0}, tasks={"free": {"jpeg_compressibility": 0.5},
                                           "counting": {"shapes": 2.0, "jpeg_compressibility": 0.0}})
    out = rs.score(images, prompts, metas, sids)
    shapes = build_reward("shapes").score(images[:3], prompts[:3], metas[:3])["shapes"]
    jpeg = build_reward("jpeg_compressibility").score(images, prompts, metas)["jpeg_compressibility"]
    assert np.array_equal(out["shapes"][:3], shapes) and np.isnan(out["shapes"][3:]).all()
    assert np.isnan(out["shapes.correct"][3:]).all() and np.isfinite(out["shapes.correct"][:3]).all()
    assert np.isnan(out["jpeg_compressibility"][[0, 2]]).all()  # single and no category: the default weights
    assert np.array_equal(out["jpeg_compressibility"][[1, 3, 4]], jpeg[[1, 3, 4]])  # weight 0 still stores it
    want = np.array([shapes[0], 2.0 * shapes[1], shapes[2], 0.5 * jpeg[3], 0.5 * jpeg[4]], np.float32)
    assert np.array_equal(out["reward"], want)
    three = RewardSet({"shapes": 1.0}, tasks={"a": {"jpeg_compressibility": 0.3, "shapes": 0.1,
                                                  "jpeg_incompressibility": 0.7}, "free": {"jpeg_incompressibility": 1.0}})
    metas3 = [{**m, "category": "a"} if i < 3 else m for i, m in enumerate(metas)]
    alone = three.score(images[:1], prompts[:1], metas3[:1], sids[:1])["reward"]
    behind = three.score(images[[3, 0]], [prompts[3], prompts[0]], [metas3[3], metas3[0]], [sids[3], sids[0]])
    assert alone[0] == behind["reward"][1]  # a sample's total sums its rewards in one order, whatever is beside it
    order = ["shapes", "jpeg_compressibility", "jpeg_incompressibility"]  # the default's, then the tasks' in turn
    assert list(three.routes.members([metas3[3], metas3[0]])) == order == list(three.routes.members(metas3))
    with pytest.raises(ScoringError, match="no shapes metadata"):  # without the routing, the free prompts fail
        RewardSet({"shapes": 1.0}).score(images, prompts, metas, sids)


def test_a_reward_no_sample_routes_to_is_not_called_and_stores_nothing():
    images, prompts, metas, sids = _batch()
    rs = RewardSet({"shapes": 1.0}, tasks={"free": {"jpeg_compressibility": 1.0}})
    first = rs.score(images[:3], prompts[:3], metas[:3], sids[:3])
    assert "jpeg_compressibility" not in first
    second = rs.score(images[3:], prompts[3:], metas[3:], sids[3:])
    merged = merge_parts([first, second], [3, 2])
    whole = rs.score(images, prompts, metas, sids)
    assert set(merged) == set(whole)
    assert all(np.array_equal(merged[k], whole[k], equal_nan=True) for k in whole)
    col = rewards_column(whole, 5).to_pylist()
    assert [sorted(i["name"] for i in row) for row in col] == [["shapes", "shapes.correct", "shapes.partial"]] * 3 \
        + [["jpeg_compressibility"]] * 2


def test_prompt_checks_see_only_the_prompts_a_reward_scores():
    prompts, metas = ["a cat", 'a sign that says "OPEN"'], [{"category": "photo"}, {"category": "text"}]
    RewardSet({"jpeg_compressibility": 1.0}, tasks={"text": {"ocr": 1.0}}).check_prompts(prompts, metas)
    with pytest.raises(ValueError, match="quotes none"):
        RewardSet({"ocr": 1.0}).check_prompts(prompts, metas)
    with pytest.raises(ValueError, match=r"reward.tasks names 'txt', which no prompt's 'category' is .*'photo', 'text'"):
        RewardSet({"jpeg_compressibility": 1.0}, tasks={"txt": {"ocr": 1.0}}).check_prompts(prompts, metas)
    routed = RewardSet({"jpeg_compressibility": 1.0}, tasks={"sign": {"ocr": 1.0}}, route_by="kind")
    routed.check_prompts(prompts, [{"kind": "photo"}, {"kind": "sign"}])


def test_a_score_read_from_every_sample_must_be_scored_by_every_task_the_prompts_use():
    rs = RewardSet({"shapes": 1.0}, tasks={"free": {"jpeg_compressibility": 1.0}})
    both, free = [{"category": "single"}, {"category": "free"}], [{"category": "free"}]
    rs.check_scores(["shapes"], "algorithm 'x'")  # stored by some samples
    with pytest.raises(ValueError, match=r"reads 'shapes' from every sample, and task 'free' does not score"):
        rs.check_scores_everywhere(["shapes"], "algorithm 'x'", both)
    with pytest.raises(ValueError, match=r"reads 'jpeg_compressibility' from every sample, and the default"):
        rs.check_scores_everywhere(["jpeg_compressibility"], "algorithm 'x'", both)
    rs.check_scores_everywhere(["jpeg_compressibility"], "algorithm 'x'", free)  # no prompt takes the default
    RewardSet({"shapes": 1.0}, tasks={"free": {"jpeg_compressibility": 1.0, "shapes": 0.0}}).check_scores_everywhere(
        ["shapes"], "algorithm 'x'", both)


def test_offline_dpo_names_the_categories_that_store_a_per_task_score():
    """An archive of a per-task run: pairing or filtering on a score some rows lack is refused,
    naming the categories whose rows have it; on those rows alone it works."""
    import pyarrow as pa

    from pixrl.artifacts.archive import ArchiveError
    from pixrl.stages.offline import pair_scores

    ocr, pick = [{"name": "ocr", "value": 0.5}], [{"name": "pickscore", "value": 0.7}]
    sel = pa.table({"reward": [0.5, 0.7], "rewards": [ocr, pick],
                    "prompt_meta": [json.dumps({"category": "ocr"}), json.dumps({"category": "photo"})]})
    with pytest.raises(ArchiveError, match=r"'ocr' is stored by 1 of the 2 selected rows .*dpo.categories=\[ocr\]"):
        pair_scores(sel, "ocr")
    assert pair_scores(sel.slice(0, 1), "ocr").tolist() == [0.5]
    with pytest.raises(ArchiveError, match="not a reward these rollouts were scored with"):
        pair_scores(sel, "hpsv2")


def test_the_config_refuses_what_routing_cannot_do():
    with pytest.raises(ValueError, match=r"reward.tasks\['ocr'\] is empty"):
        RewardConfig(tasks={"ocr": {}})
    with pytest.raises(ValueError, match="reward.aggregate=advantage is not supported"):
        RewardConfig(weights={"shapes": 1.0, "jpeg_compressibility": 1.0}, aggregate="advantage",
                     tasks={"free": {"jpeg_compressibility": 1.0}})
    rs = RewardSet.from_config(RewardConfig(tasks={"free": {"ocr": 1.0}}, options={"ocr": {"min_confidence": 0.3}}))
    assert rs.rewards["ocr"].min_confidence == 0.3  # options reach a reward that only a task names
    with pytest.raises(ValueError, match="not in reward.weights or reward.tasks"):
        RewardSet({"shapes": 1.0}, {"pickscore": {}}, tasks={"free": {"ocr": 1.0}})


def test_a_run_scores_each_category_by_its_task_through_the_flow(tiny_checkpoint, tmp_path, prefect_harness):
    """Two iterations on the miniature's counting and colors prompts, counting scored by the JPEG
    reward and colors by the shapes judge (the default), decoded and scored per micro-batch in the
    background (reward.overlap: each chunk is one group, so each lacks one reward's scores)."""
    import lance
    from mlflow.tracking import MlflowClient
    from typer.testing import CliRunner

    from pixrl.cli import app

    args = train_args(tiny_checkpoint, tmp_path, "routed", "reward=shapes", "dataset.categories=[counting,colors]",
                      "reward.tasks.counting.jpeg_compressibility=1.0", "reward.overlap=true",
                      "sampling.prompts_per_iteration=4")
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    t = lance.dataset(out["table_uri"]).to_table()
    cats = [json.loads(m)["category"] for m in t["prompt_meta"].to_pylist()]
    assert set(cats) == {"counting", "colors"} and t.num_rows == 32
    names = [sorted(i["name"] for i in row) for row in t["rewards"].to_pylist()]
    images = np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in t["image"].to_pylist()])
    metas = [json.loads(m) for m in t["prompt_meta"].to_pylist()]
    again = RewardSet({"shapes": 1.0}, tasks={"counting": {"jpeg_compressibility": 1.0}}).score(
        images, t["prompt"].to_pylist(), metas, t["sample_id"].to_pylist())
    for i, cat in enumerate(cats):
        assert names[i] == (["jpeg_compressibility"] if cat == "counting" else ["shapes", "shapes.correct",
                                                                               "shapes.partial"])
    assert np.array_equal(t["reward"].to_numpy(), again["reward"])
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(out["run_id"])
    assert {"reward/jpeg_compressibility/mean", "reward/shapes/mean", "reward/reward/mean"} <= set(run.data.metrics)
    assert run.data.params["reward.tasks.counting.jpeg_compressibility"] == "1.0"
