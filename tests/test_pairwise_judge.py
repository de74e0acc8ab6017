"""Pref-GRPO's pairwise win-rate reward (`pairwise_judge`, algorithms.md §6.2) on a tiny
Qwen2.5-VL-Instruct checkout: every pair of a group judged (both orders by default) from the
judge's first-answer-token probabilities, r_i = wins_i / comparisons_i; groups from the rollout's
sample ids, scored whole by the in-process, reward-service and Ray paths; and a run through the
real flow stores win rates that average ½ per group."""

import json
from itertools import combinations

import lance
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_overrides
from pixrl.cli import app
from pixrl.rewards.base import ScoringError, build_reward, group_keys
from pixrl.rewards.compose import RewardSet
from pixrl.rewards.pairwise_judge import CAPTIONS

PROMPTS = ["a red circle", "two blue squares", "a red circle", "two blue squares", "a red circle"]
GROUPS = ["00000-000", "00000-001", "00000-000", "00000-001", "00000-000"]  # interleaved on purpose
IDS = ["00000-000-00", "00000-001-00", "00000-000-01", "00000-001-01", "00000-000-02"]


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory):
    from pixrl.models.tiny_qwen_vl import write_tiny_qwen25_vl

    return write_tiny_qwen25_vl(tmp_path_factory.mktemp("vlm") / "Qwen2.5-VL-tiny")


def _judge(path, **kw):
    r = build_reward("pairwise_judge", path=str(path), **kw)
    r.ensure_setup("cpu")
    return r


def _images(n=5, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)


def _answer(judge, a: np.ndarray, b: np.ndarray, prompt: str) -> tuple[float, float]:
    """p(1), p(2) of one comparison as `generate` reports the first answer token's logits."""
    inputs = judge.chat_inputs([[a, b]], [judge.question.format(prompt=prompt)], CAPTIONS)
    with torch.no_grad():
        gen = judge.model.generate(**inputs, max_new_tokens=1, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)
    p = torch.softmax(gen.logits[0][0].float(), dim=-1)
    tok = judge.tokenizer.convert_tokens_to_ids
    return float(p[tok("1")]), float(p[tok("2")])


def _expected(judge, images, decision: str, both_orders: bool) -> np.ndarray:
    """r_i = wins_i / comparisons_i over the ordered pairs of each group (Pref-GRPO's count)."""
    members = {}
    for i, g in enumerate(GROUPS):
        members.setdefault(g, []).append(i)
    pairs = [pair for m in members.values() for pair in combinations(m, 2)]
    pairs += [(b, a) for a, b in pairs] if both_orders else []
    wins, count = np.zeros(len(images)), np.zeros(len(images))
    for a, b in pairs:
        p1, p2 = _answer(judge, images[a], images[b], PROMPTS[a])
        w = (1.0 if p1 > p2 else 0.0 if p1 < p2 else 0.5) if decision == "hard" else p1 / (p1 + p2)
        wins[a], wins[b] = wins[a] + w, wins[b] + 1 - w
        count[a], count[b] = count[a] + 1, count[b] + 1
    return wins / count


@pytest.mark.parametrize("decision,both_orders", [("soft", True), ("hard", True), ("soft", False)])
def test_win_rates_follow_from_the_judges_answers(judge_path, decision, both_orders):
    judge = _judge(judge_path, decision=decision, both_orders=both_orders, batch_size=3)
    images = _images()
    rs = RewardSet({"pairwise_judge": 1.0}, {"pairwise_judge": {"path": str(judge_path), "decision": decision,
                                                                 "both_orders": both_orders, "batch_size": 3}})
    out = rs.score(images, PROMPTS, [{}] * 5, IDS)  # groups from the rollout ids, rows interleaved
    want = _expected(judge, images, decision, both_orders)
    if decision == "hard":
        assert np.array_equal(out["pairwise_judge"], want.astype(np.float32))
    else:
        np.testing.assert_allclose(out["pairwise_judge"], want, atol=1e-5)
    per = 2 if both_orders else 1
    assert out["pairwise_judge.comparisons"].tolist() == [2 * per, per, 2 * per, per, 2 * per]
    for g in set(GROUPS):  # every comparison hands out one win: a group's win rates average ½
        rows = [i for i, k in enumerate(GROUPS) if k == g]
        assert abs(float(np.mean(out["pairwise_judge"][rows])) - 0.5) < 1e-6


def test_pref_grpos_rounding_on_request(judge_path):
    """Pref-GRPO's settings: one order, hard verdicts, win rates rounded to 3 decimals."""
    images = _images()
    exact = _judge(judge_path, both_orders=False).score(images, PROMPTS, [{}] * 5, groups=GROUPS)["pairwise_judge"]
    rounded = _judge(judge_path, both_orders=False, decimals=3).score(images, PROMPTS, [{}] * 5,
                                                                       groups=GROUPS)["pairwise_judge"]
    assert np.array_equal(rounded, np.round(exact.astype(np.float64), 3).astype(np.float32))


def test_a_group_scores_as_it_does_alone(judge_path):
    judge = _judge(judge_path, decision="soft")
    images = _images()
    both = judge.score(images, PROMPTS, [{}] * 5, groups=GROUPS)["pairwise_judge"]
    rows = [0, 2, 4]
    alone = judge.score(images[rows], [PROMPTS[i] for i in rows], [{}] * 3, groups=["x"] * 3)["pairwise_judge"]
    np.testing.assert_allclose(both[rows], alone, atol=1e-5)


def test_group_keys_come_from_rollout_ids_or_else_prompts():
    assert group_keys(PROMPTS, IDS) == GROUPS
    assert group_keys(["a", "b", "a"], ["x.png", "y.png", "z.png"]) == ["prompt:a", "prompt:b", "prompt:a"]


def test_a_lonely_sample_and_bad_settings_fail_naming_them(judge_path, tmp_path):
    judge = _judge(judge_path)
    with pytest.raises(ScoringError, match="alone in its group.*group_size ≥ 2"):
        judge.score(_images(3), ["a", "a", "b"], [{}] * 3, groups=["g", "g", "h"])
    with pytest.raises(ValueError, match="decision 'majority' is not one of hard, soft"):
        build_reward("pairwise_judge", path=str(judge_path), decision="majority")
    with pytest.raises(ValueError, match="reward.options.pairwise_judge.path"):
        build_reward("pairwise_judge", path=str(tmp_path))
    with pytest.raises(ValueError, match="must contain {prompt}"):
        build_reward("pairwise_judge", path=str(judge_path), question="Which is better?")
    with pytest.raises(ValueError, match="reward.options.pairwise_judge.url"):
        build_reward("pairwise_judge", backend="vllm")


def test_group_scoring_settings_are_checked_before_a_run(judge_path):
    from pixrl.config.loader import load_config
    from pixrl.stages.preflight import check_group_scoring

    check_group_scoring(load_config(None, ["sampling.group_size=4", "sampling.micro_batch=8", "reward.overlap=true"]),
                        ["pairwise_judge"])
    with pytest.raises(ValueError, match="multiple of sampling.group_size=4"):
        check_group_scoring(load_config(None, ["sampling.group_size=4", "sampling.micro_batch=2",
                                               "reward.overlap=true"]), ["pairwise_judge"])


def test_ray_reward_shards_and_service_requests_hold_whole_groups(judge_path):
    from starlette.testclient import TestClient

    from pixrl.engines.ray_engine import _group_shards
    from pixrl.rewards.service import build_app

    keys = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    assert _group_shards(keys, 2) == [(0, 4), (4, 12)]  # the cut nearest row 6: a tie of 4 and 8 goes to the first
    assert _group_shards(keys, 3) == [(0, 4), (4, 8), (8, 12)] and _group_shards(keys, 5) == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(RuntimeError, match="not together"):
        _group_shards(["a", "b", "a"], 2)

    options = {"pairwise_judge": {"path": str(judge_path), "decision": "soft"}}
    served = build_app(RewardSet({"pairwise_judge": 1.0}, options))
    rs = RewardSet({"remote": 1.0}, {"remote": {"url": "http://testserver", "groups": True, "batch": 3}})
    remote = rs.rewards["remote"]
    assert rs.groupwise and remote._requests(8, ["g"] * 4 + ["h"] * 4) == [(0, 4), (4, 8)]
    remote.client, remote.ready = TestClient(served), True
    images, ids = _images(8, seed=1), [f"00002-{k // 4:03d}-{k % 4:02d}" for k in range(8)]
    prompts = ["a red circle"] * 4 + ["two blue squares"] * 4
    got = rs.score(images, prompts, [{}] * 8, ids)["remote"]
    want = RewardSet({"pairwise_judge": 1.0}, options).score(images, prompts, [{}] * 8, ids)["pairwise_judge"]
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_pixrl_score_compares_the_files_of_a_prompt(judge_path, tmp_path):
    from pixrl.artifacts.media import png_bytes

    for k, img in enumerate(_images(3)):
        (tmp_path / f"{k}.png").write_bytes(png_bytes(img))
    res = CliRunner().invoke(app, ["score", "--reward", "pairwise_judge", "--images", str(tmp_path), "--prompt",
                                   "a red circle", f"pairwise_judge.path={judge_path}"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["file"] for r in rows] == ["0.png", "1.png", "2.png"]
    assert all(r["pairwise_judge.comparisons"] == 4 for r in rows)
    assert abs(np.mean([r["pairwise_judge"] for r in rows]) - 0.5) < 1e-6


def test_a_run_stores_win_rates_of_its_groups(judge_path, tiny_checkpoint, tmp_path, prefect_harness):
    res = CliRunner().invoke(app, ["train", "-n", "1", "--run", "pref", "reward.weights={pairwise_judge: 1.0}",
                                   f"reward.options.pairwise_judge.path={judge_path}",
                                   *tiny_overrides(tiny_checkpoint, tmp_path)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    t = lance.dataset(json.loads(res.stdout.strip().splitlines()[-1])["table_uri"]).to_table().to_pandas()
    assert len(t) == 8
    for _, g in t.groupby("group_id"):  # G = 4: each image in 2·3 comparisons, a group's rates average ½
        assert abs(g["reward"].mean() - 0.5) < 1e-6
        assert all(abs(r * 6 - round(r * 6)) < 1e-6 for r in g["reward"])
