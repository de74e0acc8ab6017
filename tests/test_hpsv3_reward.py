"""HPSv3 on a tiny checkpoint in the released layout (Qwen2-VL-Instruct checkout + HPSv3.safetensors
with transformers 4.45's keys and the reward head): the score is μ of the head on the <|Reward|>
token's final hidden state, computed as the released model computes it — the reference here loads
the weights through transformers' own legacy-key conversion, resizes the image with HPSv3's
smart_resize formula and runs the language model at sequential positions — a batch scores as its
rows alone, clips average their frames, and bad paths fail naming the fix."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen_vl_checks import upstream_size
from pixrl.rewards.base import ScoringError, build_reward
from pixrl.rewards.hpsv3 import ASK, INSTRUCTION, REWARD_TOKEN

PROMPTS = ["a red circle", "two blue squares on the left of a green triangle", "a cat"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pixrl.rewards.hpsv3_tiny import write_tiny_hpsv3

    return write_tiny_hpsv3(tmp_path_factory.mktemp("hpsv3"))


@pytest.fixture(scope="module")
def reward(tiny):
    r = build_reward("hpsv3", path=str(tiny[0]), base=str(tiny[1]), dtype="float32", batch_size=2)
    r.ensure_setup("cpu")
    return r


def _images(n=3, h=512, w=512, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """The released model as transformers loads a 4.45-layout checkpoint (its own key conversion),
    and the head built from the file's rm_head tensors."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLForConditionalGeneration

    ck, base = tiny
    tok = AutoTokenizer.from_pretrained(str(base), padding_side="right")
    tok.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    state = load_file(str(ck))
    ref = tmp_path_factory.mktemp("ref")
    cfg = AutoConfig.from_pretrained(str(base))
    cfg.text_config.vocab_size = len(tok)
    cfg.save_pretrained(str(ref))
    save_file({k: v for k, v in state.items() if not k.startswith("rm_head.")}, str(ref / "model.safetensors"))
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(ref)).eval()
    head = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                               torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).eval()
    head.load_state_dict({k[len("rm_head."):]: v for k, v in state.items() if k.startswith("rm_head.")})
    return tok, model, head


def _reference_mu_sigma(reference, base, images, prompts):
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    tok, model, head = reference
    proc = Qwen2VLImageProcessorPil.from_pretrained(str(base))
    pils = [Image.fromarray(im).resize(upstream_size(*im.shape[:2])[::-1], Image.BICUBIC) for im in images]
    pix = proc(images=pils, return_tensors="pt")
    rows = []
    for p, grid in zip(prompts, pix["image_grid_thw"]):
        msg = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": INSTRUCTION.format(text_prompt=p) + ASK}]}]
        text = tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
        rows.append(text.replace("<|image_pad|>", "<|image_pad|>" * (int(grid.prod()) // 4)))
    enc = tok(rows, return_tensors="pt", padding=True)
    with torch.no_grad():
        embeds = model.model.language_model.embed_tokens(enc["input_ids"])
        patches = model.model.visual(pix["pixel_values"], grid_thw=pix["image_grid_thw"]).pooler_output
        slots = (enc["input_ids"] == model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(slots, patches)
        hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=enc["attention_mask"])[0]
        at = enc["input_ids"] == tok.convert_tokens_to_ids(REWARD_TOKEN)
        return head(hidden[at].float()), enc, pix, model, head


def test_the_score_is_mu_of_the_head_at_the_reward_token_as_the_released_model_computes_it(reward, reference, tiny):
    imgs = [*_images(2), _images(1, 384, 640, seed=1)[0]]  # the last not square
    out = {k: np.concatenate([reward.score(np.stack([im]), [p], [{}])[k] for im, p in zip(imgs, PROMPTS)])
           for k in ("hpsv3", "hpsv3.sigma")}
    for k, (im, p) in enumerate(zip(imgs, PROMPTS)):
        want, *_ = _reference_mu_sigma(reference, tiny[1], [im], [p])
        assert abs(out["hpsv3"][k] - float(want[0, 0])) <= 1e-5 and abs(out["hpsv3.sigma"][k] - float(want[0, 1])) <= 1e-5
    grid = reward.inputs(np.stack([imgs[0]]), PROMPTS[:1])["image_grid_thw"]
    assert grid.tolist() == [[1, 32, 32]]  # 512² is read at 448²: 256 visual tokens
    h, w = upstream_size(384, 640)
    assert reward.resized(imgs[2]).size == (w, h) and abs(h * w - 256 * 28 * 28) < 28 * 28 * 20


def test_positions_are_sequential_as_in_the_released_forward_not_qwen2_vls_rope_index(reward, reference, tiny):
    """HPSv3 calls the language model without position ids; the full model's forward would place
    the image tokens on the M-RoPE grid instead, and score otherwise."""
    want, enc, pix, model, head = _reference_mu_sigma(reference, tiny[1], list(_images(1)), PROMPTS[:1])
    with torch.no_grad():
        marks = (enc["input_ids"] == model.config.image_token_id).int()
        full = model(**enc, pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"],
                     mm_token_type_ids=marks, output_hidden_states=True).hidden_states[-1]
        rope_index = head(full[enc["input_ids"] == reward.reward_id].float())
    assert abs(float(rope_index[0, 0]) - float(want[0, 0])) > 1e-5  # measured 8.7e-5; float error is ~1e-7
    assert abs(reward.score(_images(1), PROMPTS[:1], [{}])["hpsv3"][0] - float(want[0, 0])) <= 1e-5


def test_a_batch_scores_as_its_rows_alone_and_prompt_and_image_matter(reward):
    imgs = _images(3)
    batch = reward.score(imgs, PROMPTS, [{}] * 3)["hpsv3"]
    alone = np.concatenate([reward.score(imgs[i:i + 1], PROMPTS[i:i + 1], [{}])["hpsv3"] for i in range(3)])
    assert np.allclose(batch, alone, atol=1e-5) and batch.dtype == np.float32
    assert reward.score(imgs[:1], ["a cat"], [{}])["hpsv3"][0] != pytest.approx(batch[0], abs=1e-7)
    assert reward.score(imgs[1:2], PROMPTS[:1], [{}])["hpsv3"][0] != pytest.approx(batch[0], abs=1e-7)


def test_clips_average_their_frames_through_the_preset(tiny):
    from pixrl.config.loader import load_config
    from pixrl.rewards.compose import RewardSet

    cfg = load_config(None, ["reward=hpsv3", f"reward.options.hpsv3.path={tiny[0]}",
                             f"reward.options.hpsv3.base={tiny[1]}", "reward.options.hpsv3.dtype=float32"])
    rs = RewardSet(cfg.reward.weights, cfg.reward.options)
    clip = _images(3, 64, 64)[None]  # [1, F, H, W, 3]
    out = rs.score(clip, PROMPTS[:1], [{}], ["00001-000-00"])
    frames = rs.score(clip[0], PROMPTS[:1] * 3, [{}] * 3, [f"00001-000-0{i}" for i in range(3)])["hpsv3"]
    assert out["hpsv3"][0] == pytest.approx(float(frames.mean()), abs=1e-6) and out["reward"][0] == out["hpsv3"][0]


def test_bad_paths_and_checkpoints_fail_naming_the_fix(tiny, tmp_path):
    ck, base = tiny
    with pytest.raises(ValueError, match="HPSv3.safetensors"):
        build_reward("hpsv3", path=str(tmp_path / "none.safetensors"), base=str(base))
    with pytest.raises(ValueError, match="Qwen2-VL-7B-Instruct"):
        build_reward("hpsv3", path=str(ck), base=str(tmp_path))
    state = load_file(str(ck))
    save_file({k: v for k, v in state.items() if not k.startswith("rm_head.")}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ScoringError, match="holds no reward head .rm_head.0.weight is missing.*HPSv3.safetensors"):
        build_reward("hpsv3", path=str(tmp_path / "plain.safetensors"), base=str(base)).ensure_setup("cpu")
    shrunk = {k: (v[:-1] if "embed_tokens" in k or k == "lm_head.weight" else v) for k, v in state.items()}
    save_file(shrunk, str(tmp_path / "no_token.safetensors"))
    with pytest.raises(ScoringError, match="set reward.options.hpsv3.base to the Qwen2-VL-7B-Instruct"):
        build_reward("hpsv3", path=str(tmp_path / "no_token.safetensors"), base=str(base)).ensure_setup("cpu")
