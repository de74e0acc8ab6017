"""The OCR reward (flow_grpo/ocr.py's formula) with the real RapidOCR models on text rendered by
Pillow: 1.0 for the exact text, 1 − 1/|t| for one wrong character, 0 for an image without text,
at 512² and 256²; the target from quotes or metadata; clear errors before any work."""

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from pixrl.rewards.base import ScoringError, build_reward
from pixrl.rewards.ocr import ocr_reward, target_text


def test_the_reward_is_one_minus_the_capped_normalised_edit_distance():
    assert ocr_reward("Hello World", "hello world") == 1.0  # case and spaces do not count
    assert ocr_reward("the sign says HELLOWORLD!", "hello world") == 1.0  # contained: distance 0
    assert ocr_reward("HELLO WORLE", "hello world") == pytest.approx(0.9)  # 1 edit over 10 characters
    assert ocr_reward("HELO", "hello") == pytest.approx(0.8)
    assert ocr_reward("", "hello") == 0.0
    assert ocr_reward("a completely different and much longer text", "cat") == 0.0  # capped at |t|


def test_the_target_comes_from_metadata_or_the_first_quoted_span():
    assert target_text('a neon sign that says "Open 24h" at night', {}) == "Open 24h"
    assert target_text("a poster reading “Cat 2025”", {}) == "Cat 2025"
    assert target_text('a sign "x"', {"text": "from meta"}) == "from meta"
    assert target_text("a cat", {}) is None


def _render(text: str, side: int) -> np.ndarray:
    img = Image.new("RGB", (side, side), "white")
    font = ImageFont.load_default(size=side // 9)
    ImageDraw.Draw(img).text((side // 12, side // 2 - side // 18), text, fill="black", font=font)
    return np.asarray(img)


@pytest.fixture(scope="module")
def reward():
    r = build_reward("ocr")
    r.ensure_setup("cpu")
    return r


@pytest.mark.parametrize("side", [512, 256])
def test_rendered_text_is_read_back(reward, side):
    prompt = 'a white card with "HELLO WORLD" printed on it'
    images = np.stack([_render("HELLO WORLD", side), _render("HELLO WORLE", side), np.full((side, side, 3), 255, np.uint8)])
    out = reward.score(images, [prompt] * 3, [{}] * 3)
    assert out["ocr"].tolist() == pytest.approx([1.0, 0.9, 0.0], abs=1e-6)
    assert out["ocr.confidence"][0] > 0.5 and out["ocr.confidence"][2] == 0.0
    one_by_one = [reward.score(im[None], [prompt], [{}])["ocr"][0] for im in images]
    assert out["ocr"].tolist() == one_by_one  # a batch scores as its images alone


def test_prompts_without_a_target_fail_before_any_work(tmp_path):
    from typer.testing import CliRunner

    from pixrl.cli import app

    with pytest.raises(ScoringError, match="quotes none"):
        build_reward("ocr").score(np.zeros((1, 8, 8, 3), np.uint8), ["a cat"], [{}])
    res = CliRunner().invoke(app, ["train", "--iterations", "1", "reward=ocr", f"run.workdir={tmp_path}"])
    assert res.exit_code != 0 and "quotes none" in res.output, res.output  # the shapes prompts quote no text
    assert not (tmp_path / "lance").exists()
