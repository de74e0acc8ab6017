"""UnifiedReward's pointwise score (flow_grpo's `unifiedreward` reward): a tiny Qwen2.5-VL judge,
taught here to answer in UnifiedReward's format, is asked flow_grpo's question about each image
(resized to `image_size`², bicubic) greedily; the reward is its "Final Score: s" / 5. An answer
without a score fails naming the prompt and what the judge said (flow_grpo scores it 0); the
served backend sends flow_grpo's chat completion."""

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from pixrl.rewards.base import ScoringError, build_reward
from pixrl.rewards.unified_reward import QUESTION, final_score, judged_pixels

PROMPTS = ["a red circle", "two blue squares"]
ANSWERS = ["The caption matches. Final Score: 4", "Poor match. Final Score: 2.5"]


def _images():
    return np.random.default_rng(0).integers(0, 256, (2, 40, 64, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    from pixrl.models.tiny_qwen_vl import write_tiny_qwen25_vl

    return write_tiny_qwen25_vl(tmp_path_factory.mktemp("ur") / "tiny-judge")


@pytest.fixture(scope="module")
def taught(checkout, tmp_path_factory):
    """The tiny judge fitted (teacher forcing) to answer each of two image–prompt pairs as
    UnifiedReward does, saved as a checkout: a model that really generates the format."""
    judge = build_reward("unified_reward", path=str(checkout), image_size=56, max_tokens=64)
    judge.ensure_setup("cpu")
    model, tok = judge.model, judge.tokenizer
    rows = []
    for img, prompt, answer in zip(_images(), PROMPTS, ANSWERS):
        inputs = judge.inputs(judged_pixels(img[None], 56), [prompt])
        tail = torch.tensor([tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]])
        ids = torch.cat([inputs["input_ids"], tail], 1)
        labels = torch.cat([torch.full_like(inputs["input_ids"], -100), tail], 1)
        rows.append({**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                     "mm_token_type_ids": torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(tail)], 1)})
    torch.manual_seed(0)
    model.train().requires_grad_(True)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(160):
        loss = model(**rows[step % 2]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = tmp_path_factory.mktemp("ur") / "taught-judge"
    model.eval().requires_grad_(False).save_pretrained(str(out))
    for f in checkout.iterdir():
        if not (out / f.name).exists():
            (out / f.name).write_bytes(f.read_bytes())
    return out


def test_the_score_is_the_judges_final_score_over_five(taught):
    judge = build_reward("unified_reward", path=str(taught), image_size=56, max_tokens=64)
    judge.ensure_setup("cpu")
    assert [a.strip() for a in judge.answers(_images(), PROMPTS)] == ANSWERS  # greedy, batched (left-padded)
    out = judge.score(_images(), PROMPTS, [{}, {}])
    assert np.array_equal(out["unified_reward"], np.float32([4.0, 2.5]) / 5)
    assert out["unified_reward.raw"].tolist() == [4.0, 2.5]


def test_an_answer_without_a_score_fails_naming_the_prompt(checkout):
    judge = build_reward("unified_reward", path=str(checkout), image_size=56, max_tokens=6)
    judge.ensure_setup("cpu")
    with pytest.raises(ScoringError, match=r"2 of 2 answers hold no 'Final Score: s'.*'a red circle'.*max_tokens"):
        judge.score(_images(), PROMPTS, [{}, {}])


def test_final_score_reads_flow_grpos_pattern():
    assert final_score("Reasoning ... Final Score: 3") == 3.0
    assert final_score("Final Score:4.25 then Final Score: 1") == 4.25  # the first, as re.search
    assert final_score("Final Score: 0") is None and final_score("Final Score: 6") is None
    assert final_score("score 5") is None


def test_the_served_backend_sends_flow_grpos_request():
    """The chat completion flow_grpo sends its SGLang server: the image resized to 512² (PNG),
    then its question with the prompt as the caption, temperature 0; an unreachable server is named."""
    judge = build_reward("unified_reward", backend="vllm", url="http://127.0.0.1:9", served_model="ur")
    img = _images()[0]
    req = judge.served_request(judged_pixels(img[None], 512)[0], PROMPTS[0])
    assert (req["model"], req["temperature"], req["max_tokens"]) == ("ur", 0.0, 512) and "logprobs" not in req
    image_part, text_part = req["messages"][0]["content"]
    png = base64.b64decode(image_part["image_url"]["url"].split(",", 1)[1])
    sent = np.asarray(Image.open(io.BytesIO(png)))
    assert np.array_equal(sent, np.asarray(Image.fromarray(img).resize((512, 512), Image.BICUBIC)))
    assert text_part["text"] == QUESTION.format(prompt=PROMPTS[0]) and text_part["text"].startswith("<image>\n")
    assert text_part["text"].endswith("Text Caption: [a red circle]")
    with pytest.raises(ScoringError, match=r"no vLLM server answers at http://127.0.0.1:9"):
        judge.ensure_setup("cpu")
    with pytest.raises(ValueError, match="image_size=8"):
        build_reward("unified_reward", backend="vllm", url="http://127.0.0.1:9", image_size=8)
