"""Qwen-Image-Edit on a tiny random checkpoint written by `pixrl tiny qwen_image_edit` (the released
layout: a QwenImageEditPipeline whose processor is Qwen2VLProcessor's files, the edit template's
system part the 64 tokens the pipeline drops): the instruction encoded with its source image as the
pipeline's own encoding computes it once the processor's image marks reach Qwen2.5-VL (and how far
diffusers' call without them lands), ODE parity with QwenImageEditPipeline under true CFG whose
negative prompt is encoded with each row's image, replay exact, the refusals, and two RL iterations
through the unchanged flow (LoRA and full fine-tuning) with a replay of the recorded update."""

import io
import json

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from conftest import two_iterations
from family_checks import WithImageMarks, assert_replay_is_on_policy, edit_pipeline_latents, gens, row_negatives, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.cli import app
from pixrl.engines.prompt_cache import PromptCache
from pixrl.models.base import ModelLoadError
from pixrl.models.qwen_image_edit import QwenImageEditFamily
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.source_images import SourceImageError, condition_keys

PROMPTS = ["make the sky red", "add a blue square"]


@pytest.fixture(scope="module")
def tiny_qie(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-qwen_image_edit"
    return out, QwenImageEditFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_qie):
    return QwenImageEditFamily.load(tiny_qie[0], max_sequence_length=64, resolution=32)


@pytest.fixture(scope="module")
def sources(tiny_qie):
    return [(tiny_qie[0] / "edits" / f"source_{i}.png").read_bytes() for i in range(2)]


def test_registered_found_from_its_layout_and_its_template_crop_is_the_releases(tiny_qie, family):
    assert get_family("qwen_image_edit") is QwenImageEditFamily and QwenImageEditFamily.needs_images
    assert family_of_directory(tiny_qie[0]) == "qwen_image_edit"
    index = json.loads((tiny_qie[0] / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline" and index["processor"] == ["transformers", "Qwen2VLProcessor"]
    tok = family.pipe.processor.tokenizer
    ids = tok(family.pipe.prompt_template_encode.format("x"))["input_ids"]
    assert tok.convert_ids_to_tokens(ids[64]) == "<|vision_start|>"  # the 64 dropped tokens: the system turn


def test_encoding_is_the_pipelines_with_the_image_marks(family, sources):
    cond = family.encode_prompts(PROMPTS, sources)
    assert cond.image_latents.shape == (2, 4096, 16) and cond.source_grid == (64, 64)  # 1024² sources, VAE 8×
    plain = family.pipe.text_encoder
    try:
        family.pipe.text_encoder = WithImageMarks(plain)
        for i, (p, im) in enumerate(zip(PROMPTS, sources)):
            want, _ = family.pipe._get_qwen_prompt_embeds(p, family.source(im), family.device)
            n = want.shape[1]
            assert torch.equal(cond.prompt_embeds[i, :n], want[0])
            assert cond.mask is None or (bool(cond.mask[i, :n].all()) and not cond.mask[i, n:].any())
    finally:
        family.pipe.text_encoder = plain
    unmarked, _ = family.pipe._get_qwen_prompt_embeds(PROMPTS[0], family.source(sources[0]), family.device)
    assert (unmarked[0] - cond.prompt_embeds[0, :unmarked.shape[1]]).abs().max() > 1e-4  # diffusers' call, as is


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (4.0, "blurry, low quality")])  # a negative of several tokens
def test_ode_sampling_equals_the_pipeline_with_the_negative_read_with_each_image(family, sources, cfg, negative):
    cond = family.encode_prompts(PROMPTS, sources)
    neg = row_negatives(family, PROMPTS, sources, negative) if cfg > 1 else None
    if neg is not None:  # each row's negative conditioning is the negative prompt with that row's source
        assert torch.equal(neg.prompt_embeds[1], family.encode_prompts([negative], sources[1:]).prompt_embeds[0])
        assert not torch.equal(neg.prompt_embeds[0], neg.prompt_embeds[1])
    recipe = SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=(), negative_prompt=negative or "")
    traj = sample(family, cond, neg, gens([3, 4]), recipe)
    ref = edit_pipeline_latents(family, cond, neg, [family.source(im) for im in sources], cfg, [3, 4])
    assert (family.pipe._pack_latents(traj.final, 2, *family.latent_shape()) - ref).abs().max().item() <= 1e-5
    other = sample(family, family.encode_prompts(PROMPTS, sources[::-1]), neg, gens([3, 4]), recipe)
    assert (other.final - traj.final).abs().max().item() > 1e-4  # the source reaches the velocity


def test_a_non_square_edit_equals_the_pipeline(tiny_qie, sources):
    """A 32×48 target: each source centre-cropped to its aspect, then read at the pipeline's areas."""
    fam = wide(QwenImageEditFamily, tiny_qie[0], 32, 48, max_sequence_length=64)
    read = fam.source(sources[0])
    assert abs(read.width / read.height - 1.5) < 0.1  # the target's aspect (sized to 32-px steps)
    cond = fam.encode_prompts(PROMPTS, sources)  # (CFG with each row's negative: the square tests)
    traj = sample(fam, cond, None, gens([3, 4]), SamplerRecipe(6, 0.0, train_steps=()))
    ref = edit_pipeline_latents(fam, cond, None, [fam.source(im) for im in sources], 1.0, [3, 4])
    assert (fam.pipe._pack_latents(traj.final, 2, *fam.latent_shape()) - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, sources, sde_type, window):
    neg = row_negatives(family, PROMPTS, sources, " ")
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=4.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, sources), neg, recipe)


def test_a_process_without_text_towers_gets_each_rows_negative_with_the_encodings(family, tiny_qie, sources):
    """A Ray worker or trainer rank: the rollout's negative sets travel with its prompt sets."""
    bare = QwenImageEditFamily.load(tiny_qie[0], max_sequence_length=64, resolution=32, text_towers=False)
    keys = condition_keys(PROMPTS, sources)
    exported = PromptCache(family).encodings([keys], " ", sources)
    assert exported["negative"] is None and len(exported["sets"]) == 2  # the prompts', the negative's
    want = PromptCache(family).negative_rows(" ", keys, sources).of(keys[::-1])
    got = PromptCache.holding(bare, exported).negative_rows(" ", keys).of(keys[::-1])
    assert torch.equal(got.prompt_embeds, want.prompt_embeds) and torch.equal(got.image_latents, want.image_latents)
    with pytest.raises(RuntimeError, match="no source image with digest .* was given"):  # a miss: nothing to encode
        PromptCache.holding(bare, exported).negative_rows("another negative", keys)


def test_refusals_name_the_fix(family, tiny_qie):
    with pytest.raises(SourceImageError, match="edits images: every prompt needs a source image"):
        family.encode_prompts(PROMPTS)
    from pixrl.models.qwen_image import QwenImageFamily

    with pytest.raises(ModelLoadError, match="QwenImageEditPipeline, not a QwenImagePipeline"):
        QwenImageFamily.load(tiny_qie[0], max_sequence_length=64)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_rl_iterations_through_the_unchanged_flow(tiny_qie, tmp_path, prefect_harness, mode):
    """True CFG with each row's own negative conditioning; the full run's update replays exactly."""
    out, t = two_iterations(tiny_qie, tmp_path, f"qie_{mode}", mode, "sampling.guidance_scale=4.0",
                            "sampling.negative_prompt=' '")
    assert t["source_image"].null_count == 0 and json.loads(t["recipe"][0].as_py())["negative_prompt"] == " "
    if mode == "full":
        rep = CliRunner().invoke(app, ["replay", f"qie_{mode}", "--iteration", "1", "--workdir", str(tmp_path)])
        assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output
        res = CliRunner().invoke(app, ["generate", "--run", f"qie_{mode}", "--workdir", str(tmp_path), "--prompt",
                                       PROMPTS[0], "--image", str(tiny_qie[0] / "edits" / "source_0.png"),
                                       "--out", str(tmp_path / "gen"), "--steps", "2"])
        assert res.exit_code == 0, res.output
        assert Image.open(io.BytesIO((tmp_path / "gen" / "0000_00.png").read_bytes())).size == (32, 32)
