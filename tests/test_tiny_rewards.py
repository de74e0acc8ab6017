"""`pixrl tiny-reward`: a tiny random checkpoint of a model-based reward in its released layout,
written complete or not at all, whose printed overrides score with the real reward class."""

import json

import numpy as np
from typer.testing import CliRunner

from pixrl.artifacts.media import wav_bytes
from pixrl.cli import app
from pixrl.rewards.compose import RewardSet


def _options(overrides: dict, name: str) -> dict:
    prefix = f"reward.options.{name}."
    return {k[len(prefix):]: v for k, v in overrides.items() if k.startswith(prefix)}


def test_the_printed_overrides_score_with_the_real_reward(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["tiny-reward", "clip_score", "--out", str(tmp_path / "clip")])
    assert res.exit_code == 0, res.output
    overrides = json.loads(res.stdout.strip().splitlines()[-1])
    assert overrides["reward.weights.clip_score"] == 1.0 and list(tmp_path.iterdir()) == [tmp_path / "clip"]
    images = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    scores = RewardSet({"clip_score": 1.0}, {"clip_score": _options(overrides, "clip_score")}).score(
        images, ["a red circle", "a blue square"], [{}, {}], ["a", "b"])
    assert np.isfinite(scores["clip_score"]).all()

    res = runner.invoke(app, ["tiny-reward", "aesthetic", "--out", str(tmp_path / "aesthetic")])
    assert res.exit_code == 0, res.output
    aesthetic = _options(json.loads(res.stdout.strip().splitlines()[-1]), "aesthetic")
    got = RewardSet({"aesthetic": 1.0}, {"aesthetic": aesthetic}).score(images, ["x", "y"], [{}, {}], ["a", "b"])
    assert np.isfinite(got["aesthetic"]).all()

    res = runner.invoke(app, ["tiny-reward", "clap_score", "--out", str(tmp_path / "clap"), "--seed", "1"])
    assert res.exit_code == 0, res.output
    clap = _options(json.loads(res.stdout.strip().splitlines()[-1]), "clap_score")
    tone = np.sin(np.arange(8000) / 8.0)[None].astype(np.float32)
    got = RewardSet({"clap_score": 1.0}, {"clap_score": clap}).score(
        np.zeros((1, 2, 8, 8, 3), np.uint8), ["a bell"], [{"soundtrack": wav_bytes(tone, 16000)}], ["a"])
    assert np.isfinite(got["clap_score"]).all()


def test_refusals_name_the_fix(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["tiny-reward", "jpeg_compressibility", "--out", str(tmp_path / "j")])
    assert res.exit_code != 0 and "no tiny checkpoint writer" in res.output and "clip_score" in res.output
    assert not list(tmp_path.iterdir())  # nothing half-written
    (tmp_path / "taken").mkdir()
    res = runner.invoke(app, ["tiny-reward", "clip_score", "--out", str(tmp_path / "taken")])
    assert res.exit_code != 0 and "already exists" in res.output
