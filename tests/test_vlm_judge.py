"""The VLM judge on a tiny Qwen2.5-VL-Instruct checkout written in the Hub layout (model, tokenizer
with the vision tokens and chat template, Qwen2VLImageProcessor config): the score is
p(yes)/(p(yes)+p(no)) from the model's own first-answer-token logits (as `generate` reports
them), deterministic, a batch scores as its images alone, and bad settings fail naming them."""

import numpy as np
import pytest
import torch

from pixrl.rewards.base import ScoringError, build_reward

PROMPTS = ["a red circle", "two blue squares on the left of a green triangle", "a cat"]


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    from pixrl.models.tiny_qwen_vl import write_tiny_qwen25_vl

    path = write_tiny_qwen25_vl(tmp_path_factory.mktemp("vlm") / "Qwen2.5-VL-tiny")
    r = build_reward("vlm_judge", path=str(path), batch_size=2)
    r.ensure_setup("cpu")
    return r


def _images(n=3):
    return np.random.default_rng(0).integers(0, 256, (n, 64, 48, 3), dtype=np.uint8)


def test_the_score_is_the_yes_probability_of_the_models_first_answer_token(judge):
    imgs = _images()
    out = judge.score(imgs, PROMPTS, [{}] * 3)
    assert np.all((out["vlm_judge"] >= 0) & (out["vlm_judge"] <= 1))
    with torch.no_grad():
        gen = judge.model.generate(**judge.inputs(imgs, PROMPTS), max_new_tokens=1, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True)
    p = torch.softmax(gen.logits[0].float(), dim=-1)
    yes = sum(p[:, judge.tokenizer.convert_tokens_to_ids(w)] for w in ("Yes", "yes"))
    no = sum(p[:, judge.tokenizer.convert_tokens_to_ids(w)] for w in ("No", "no"))
    assert np.allclose(out["vlm_judge"], (yes / (yes + no)).numpy(), atol=1e-6)
    assert np.allclose(out["vlm_judge.p_yes"], yes.numpy(), atol=1e-7)


def test_deterministic_and_a_batch_scores_as_its_images_alone(judge):
    imgs = _images()
    first = judge.score(imgs, PROMPTS, [{}] * 3)["vlm_judge"]
    assert np.array_equal(judge.score(imgs, PROMPTS, [{}] * 3)["vlm_judge"], first)
    alone = [judge.score(imgs[i:i + 1], PROMPTS[i:i + 1], [{}])["vlm_judge"][0] for i in range(3)]
    assert np.allclose(alone, first, atol=1e-5)


def test_bad_settings_are_refused_naming_them(judge, tmp_path):
    with pytest.raises(ValueError, match="reward.options.vlm_judge.path"):
        build_reward("vlm_judge", path=str(tmp_path))
    with pytest.raises(ValueError, match="must contain {prompt}"):
        build_reward("vlm_judge", path=judge.path, question="Is it good?")
    r = build_reward("vlm_judge", path=judge.path, yes=("Yes indeed",))
    with pytest.raises(ScoringError, match="one token each"):
        r.ensure_setup("cpu")


def test_vllm_backend_reads_the_answer_probabilities_from_the_top_logprobs():
    """OpenAI's chat-completions schema, as vLLM fills it: exact spellings summed, others ignored."""
    from math import log

    from pixrl.rewards.vlm_judge_vllm import answer_probs

    top = [{"token": "Yes", "logprob": log(0.5)}, {"token": "yes", "logprob": log(0.1)},
           {"token": " Yes", "logprob": log(0.05)}, {"token": "No", "logprob": log(0.2)},
           {"token": "Maybe", "logprob": log(0.15)}]
    py, pn = answer_probs(top, ("Yes", "yes"), ("No", "no"))
    assert abs(py - 0.6) < 1e-12 and abs(pn - 0.2) < 1e-12
    assert answer_probs([{"token": "Maybe", "logprob": 0.0}], ("Yes",), ("No",)) == (0.0, 0.0)


def test_vllm_backend_settings_and_an_unreachable_server_fail_naming_them():
    with pytest.raises(ValueError, match="reward.options.vlm_judge.url"):
        build_reward("vlm_judge", backend="vllm")
    with pytest.raises(ValueError, match="not one of transformers, vllm"):
        build_reward("vlm_judge", backend="sglang", url="http://127.0.0.1:9")
    r = build_reward("vlm_judge", backend="vllm", url="http://127.0.0.1:9")  # no checkout needed: the server has it
    with pytest.raises(ScoringError, match=r"no vLLM server answers at http://127.0.0.1:9.*vllm serve"):
        r.ensure_setup("cpu")


def test_the_judge_reads_images_at_qwens_m_rope_positions(judge):
    """The inputs mark the image tokens (`mm_token_type_ids`, as Qwen's processor returns them), so
    the model places them on its image-aware M-RoPE grid; without the marks transformers would
    quietly use plain sequential positions and judge otherwise."""
    imgs = _images(2)
    inputs = judge.inputs(imgs, PROMPTS[:2])
    image_id = judge.model.config.image_token_id
    assert torch.equal(inputs["mm_token_type_ids"].bool(), inputs["input_ids"] == image_id)
    vl = judge.model.model
    positions, _ = vl.get_rope_index(inputs["input_ids"], image_grid_thw=inputs["image_grid_thw"],
                                     attention_mask=inputs["attention_mask"],
                                     mm_token_type_ids=inputs["mm_token_type_ids"])
    with torch.no_grad():
        grid = judge.model(**{k: v for k, v in inputs.items() if k != "mm_token_type_ids"}, position_ids=positions)
        plain = judge.model(**{k: v for k, v in inputs.items() if k != "mm_token_type_ids"})
        own = judge.model(**inputs)
    assert torch.allclose(own.logits[:, -1], grid.logits[:, -1], atol=1e-5)
    assert not torch.allclose(own.logits[:, -1], plain.logits[:, -1], atol=1e-5)
