"""EditReward on a tiny checkpoint in the released layout (a Qwen2.5-VL-Instruct checkout + the
multi-head reward model's model.safetensors): each edit read twice — source, edited image and one
rubric each — each reading scored by its own head at the <|Reward|> token, the two (μ, σ) fused by
the mean, as the released inferencer computes it (the reference here loads the model through
transformers, resizes both images with the upstream smart_resize formula and calls the model with
input embeddings as its forward does); the source and the instruction matter, a batch scores as
its rows alone, the fusions, and bad paths fail naming the fix."""

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen_vl_checks import upstream_size
from pixrl.models.source_images import png_bytes
from pixrl.rewards.base import ScoringError, build_reward
from pixrl.rewards.editreward import RUBRICS
from pixrl.rewards.hpsv3 import ASK, REWARD_TOKEN

PROMPTS = ["make the circle blue", "add a red square on the left", "remove the star"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pixrl.rewards.editreward_tiny import write_tiny_editreward

    return write_tiny_editreward(tmp_path_factory.mktemp("editreward"))


@pytest.fixture(scope="module")
def reward(tiny):
    r = build_reward("editreward", path=str(tiny[0]), base=str(tiny[1]), dtype="float32", batch_size=2)
    r.ensure_setup("cpu")
    return r


def _images(n=3, h=96, w=96, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def _meta(sources):
    return [{"source_image": png_bytes(s)} for s in sources]


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """The released model as transformers loads it, and its two heads from the file."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    ckpt, base = tiny
    tok = AutoTokenizer.from_pretrained(str(base), padding_side="right")
    tok.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    state = load_file(str(ckpt / "model.safetensors"))
    ref = tmp_path_factory.mktemp("ref")
    cfg = AutoConfig.from_pretrained(str(base))
    cfg.text_config.vocab_size = len(tok)
    cfg.save_pretrained(str(ref))
    save_file({k: v for k, v in state.items() if not k.startswith("rm_heads.")}, str(ref / "model.safetensors"))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(ref)).eval()
    heads = []
    for i in range(2):
        head = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                                   torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).eval()
        head.load_state_dict({k[len(f"rm_heads.head_{i}."):]: v for k, v in state.items()
                              if k.startswith(f"rm_heads.head_{i}.")})
        heads.append(head)
    return tok, model, heads


def _reference(reference, base, sources, edits, prompts, image_aware=False):
    """(fused [B, 2], per-head μ, the reward tokens' hidden states) as EditRewardInferencer.reward computes them."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    tok, model, heads = reference
    proc = Qwen2VLImageProcessorPil.from_pretrained(str(base))
    size = lambda im: upstream_size(*im.shape[:2])[::-1]  # noqa: E731
    outs, states = [], []
    for k, rubric in enumerate(RUBRICS.values()):
        pils = [Image.fromarray(im).resize(size(im), Image.BICUBIC) for pair in zip(sources, edits) for im in pair]
        pix = proc(images=pils, return_tensors="pt")
        grids = iter(pix["image_grid_thw"])
        rows = []
        for p in prompts:
            msg = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                {"type": "text", "text": rubric.format(text_prompt=p) + ASK}]}]
            text = tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
            for _ in range(2):
                text = text.replace("<|image_pad|>", "<|IMG|>" * (int(next(grids).prod()) // 4), 1)
            rows.append(text.replace("<|IMG|>", "<|image_pad|>"))
        enc = tok(rows, return_tensors="pt", padding=True)
        with torch.no_grad():
            if image_aware:  # the full model's forward: Qwen2.5-VL's image-aware rope index
                marks = (enc["input_ids"] == model.config.image_token_id).int()
                hidden = model(**enc, pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"],
                               mm_token_type_ids=marks, output_hidden_states=True).hidden_states[-1]
            else:  # the released forward: embeddings in, no position ids
                embeds = model.get_input_embeddings()(enc["input_ids"])
                patches = model.model.visual(pix["pixel_values"], grid_thw=pix["image_grid_thw"]).pooler_output
                slots = (enc["input_ids"] == model.config.image_token_id).unsqueeze(-1).expand_as(embeds)
                embeds = embeds.masked_scatter(slots, patches)
                hidden = model.model(input_ids=None, inputs_embeds=embeds, attention_mask=enc["attention_mask"])[0]
            at = enc["input_ids"] == tok.convert_tokens_to_ids(REWARD_TOKEN)
            outs.append(heads[k](hidden[at].float()))
            states.append(hidden[at])
    return torch.stack(outs).mean(0), [o[:, 0] for o in outs], states


def test_the_score_fuses_both_readings_as_the_released_inferencer(reward, reference, tiny):
    sources, edits = _images(2, seed=1), _images(2, 120, 200, seed=2)  # the edits not square
    out = reward.score(edits, PROMPTS[:2], _meta(sources))
    want, per_head, _ = _reference(reference, tiny[1], list(sources), list(edits), PROMPTS[:2])
    assert np.allclose(out["editreward"], want[:, 0].numpy(), atol=1e-5)
    assert np.allclose(out["editreward.following"], per_head[0].numpy(), atol=1e-5)
    assert np.allclose(out["editreward.quality"], per_head[1].numpy(), atol=1e-5)
    grids = reward.inputs(list(sources[:1]), edits[:1], PROMPTS[:1], "quality")["image_grid_thw"].tolist()
    h, w = upstream_size(120, 200)
    assert grids == [[1, 32, 32], [1, h // 14, w // 14]] and (h, w) == (364, 588)  # 96² is read at 448²


def test_positions_are_sequential_as_in_the_released_forward(reward, reference, tiny):
    sources, edits = _images(1, seed=3), _images(1, seed=4)
    want, _, states = _reference(reference, tiny[1], list(sources), list(edits), PROMPTS[:1])
    _, _, aware = _reference(reference, tiny[1], list(sources), list(edits), PROMPTS[:1], image_aware=True)
    assert (aware[0] - states[0]).abs().max() > 1e-3  # the image-aware index reads the tokens otherwise
    assert abs(reward.score(edits, PROMPTS[:1], _meta(sources))["editreward"][0] - float(want[0, 0])) <= 1e-5


def test_source_instruction_and_batch(reward):
    sources, edits = _images(3, seed=5), _images(3, seed=6)
    batch = reward.score(edits, PROMPTS, _meta(sources))["editreward"]
    alone = np.concatenate([reward.score(edits[i:i + 1], PROMPTS[i:i + 1], _meta(sources[i:i + 1]))["editreward"]
                            for i in range(3)])
    assert np.allclose(batch, alone, atol=1e-5) and batch.dtype == np.float32
    other_source = reward.score(edits[:1], PROMPTS[:1], _meta(sources[1:2]))["editreward"][0]
    other_prompt = reward.score(edits[:1], ["turn it upside down"], _meta(sources[:1]))["editreward"][0]
    assert other_source != pytest.approx(batch[0], abs=1e-7) and other_prompt != pytest.approx(batch[0], abs=1e-7)
    with pytest.raises(ScoringError, match="compares an edit with its source image"):
        reward.score(edits[:1], PROMPTS[:1], [{}])


def test_the_fusions(reward):
    heads = [torch.tensor([[1.0, 0.1], [2.0, -0.3]]), torch.tensor([[3.0, 0.5], [0.0, 0.2]])]
    reward.pooling = "min"
    assert torch.equal(reward.fused(heads), torch.tensor([[1.0, 0.1], [0.0, -0.3]]))
    reward.pooling = "sum"
    fused = reward.fused(heads)
    assert torch.allclose(fused[:, 0], torch.tensor([4.0, 2.0]))
    assert torch.allclose(fused[:, 1].exp() ** 2, torch.tensor([math.exp(0.2) + math.exp(1.0),
                                                                math.exp(-0.6) + math.exp(0.4)]))
    reward.pooling = "mean"


def test_bad_paths_and_checkpoints_fail_naming_the_fix(tiny, tmp_path):
    ckpt, base = tiny
    with pytest.raises(ValueError, match="holds no checkpoint.*model.safetensors or model.pth"):
        build_reward("editreward", path=str(tmp_path), base=str(base))
    with pytest.raises(ValueError, match="Qwen2.5-VL-7B-Instruct"):
        build_reward("editreward", path=str(ckpt), base=str(tmp_path))
    with pytest.raises(ValueError, match="pooling 'max'"):
        build_reward("editreward", path=str(ckpt), base=str(base), pooling="max")
    state = load_file(str(ckpt / "model.safetensors"))
    save_file({k: v for k, v in state.items() if not k.startswith("rm_heads.head_1.")}, str(tmp_path / "one.safetensors"))
    with pytest.raises(ScoringError, match="rm_heads.head_1.0.weight is missing.*ranknet_multi_head"):
        build_reward("editreward", path=str(tmp_path / "one.safetensors"), base=str(base)).ensure_setup("cpu")
    torch.save({"model": state}, str(tmp_path / "model.pth"))  # the inferencer's other file, wrapped
    pth = build_reward("editreward", path=str(tmp_path), base=str(base), dtype="float32")
    assert pth.path.endswith("model.pth")
    pth.ensure_setup("cpu")


def test_flux_kontext_trains_on_editreward_through_the_flow(tiny_flux_kontext, tiny, tmp_path, prefect_harness):
    """Two iterations of FLUX.1 Kontext edits scored by EditReward (each row's source read beside its
    edit): both heads stored with every row, the reward their fused μ, `pixrl replay` exact."""
    import json

    import lance
    from typer.testing import CliRunner

    from conftest import tiny_overrides
    from pixrl.cli import app

    path, o = tiny_flux_kontext
    extra = {k: v for k, v in o.items() if k != "model.path"}
    res = CliRunner().invoke(app, ["train", "--iterations", "2", "--run", "kontext-er", "reward=editreward",
                                   f"reward.options.editreward.path={tiny[0]}", f"reward.options.editreward.base={tiny[1]}",
                                   "reward.options.editreward.dtype=float32", "sampling.guidance_scale=2.5",
                                   *tiny_overrides(path, tmp_path, **extra)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    t = lance.dataset(out["table_uri"]).to_table()
    assert t.num_rows == 16 and t["source_image"].null_count == 0
    comps = [{c["name"]: c["value"] for c in row} for row in t["rewards"].to_pylist()]
    assert all({"editreward.following", "editreward.quality"} <= set(c) for c in comps)
    fused = [(c["editreward.following"] + c["editreward.quality"]) / 2 for c in comps]
    assert np.allclose(t["reward"].to_numpy(), fused, atol=1e-5)
    rep = CliRunner().invoke(app, ["replay", "kontext-er", "--iteration", "1", "--workdir", str(tmp_path)])
    assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output


def test_preflight_refuses_a_text_only_prompt_set(tiny, tmp_path):
    """EditReward compares each edit with its source: a prompt set without images is refused
    before anything runs."""
    from typer.testing import CliRunner

    from pixrl.cli import app

    res = CliRunner().invoke(app, ["train", "-n", "1", "--workdir", str(tmp_path / "wd"), "reward=editreward",
                                   f"reward.options.editreward.path={tiny[0]}", f"reward.options.editreward.base={tiny[1]}"])
    assert res.exit_code == 2 and "source image" in " ".join(res.output.split()), res.output
    assert not (tmp_path / "wd").exists()


def test_the_presets():
    from pixrl.config.loader import load_config

    cfg = load_config("flux2_klein_edit_editreward", ["model.path=/x", "dataset.path=/x.jsonl",
                                                      "reward.options.editreward.path=/r", "reward.options.editreward.base=/b"])
    assert cfg.model.family == "flux2_klein" and cfg.dataset.name == "edits"
    assert cfg.reward.weights == {"editreward": 1.0} and cfg.reward.options["editreward"]["dtype"] == "bfloat16"
