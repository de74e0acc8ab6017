"""Qwen-Image-Edit-2509 / 2511 on tiny random checkpoints written by `pixrl tiny qwen_image_edit_plus`
(a QwenImageEditPlusPipeline in the released layout; 2511's transformer modulates the source tokens
at timestep 0, `zero_cond_t`): the source read by Qwen2.5-VL at 384² after "Picture 1: " and
encoded by the VAE at 1024², the encoding the pipeline's own once the processor's image marks reach
Qwen2.5-VL, ODE parity with QwenImageEditPlusPipeline given the raw source (it sizes both reads
itself) under true CFG with each row's negative read with its source, replay exact, and two RL
iterations through the unchanged flow with a replay of the recorded update."""

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
from pixrl.models.base import ModelLoadError
from pixrl.models.qwen_image_edit_plus import QwenImageEditPlusFamily
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.source_images import crop_to_aspect, decode_rgb

PROMPTS = ["make the sky red", "add a blue square"]


def _write(tmp_path_factory, zero_cond_t):
    out = tmp_path_factory.mktemp("ckpt") / f"tiny-qwen_image_edit_plus-{zero_cond_t}"
    return out, QwenImageEditPlusFamily.write_tiny(out, seed=0, zero_cond_t=zero_cond_t)


@pytest.fixture(scope="module")
def tiny_2511(tmp_path_factory):
    return _write(tmp_path_factory, True)


@pytest.fixture(scope="module")
def family(tiny_2511):
    return QwenImageEditPlusFamily.load(tiny_2511[0], max_sequence_length=64, resolution=32)


@pytest.fixture(scope="module")
def family_2509(tmp_path_factory):
    path, _ = _write(tmp_path_factory, False)
    return QwenImageEditPlusFamily.load(path, max_sequence_length=64, resolution=32)


@pytest.fixture(scope="module")
def sources(tiny_2511):
    return [(tiny_2511[0] / "edits" / f"source_{i}.png").read_bytes() for i in range(2)]


def test_registered_found_from_its_layout_with_2511s_transformer(tiny_2511, family):
    assert get_family("qwen_image_edit_plus") is QwenImageEditPlusFamily and QwenImageEditPlusFamily.needs_images
    assert family_of_directory(tiny_2511[0]) == "qwen_image_edit_plus"
    index = json.loads((tiny_2511[0] / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline" and family.transformer.config.zero_cond_t
    tok = family.pipe.processor.tokenizer
    ids = tok(family.pipe.prompt_template_encode.format(family.image_prompt + "x"))["input_ids"]
    assert tok.decode(ids[64:]).startswith("Picture 1: <|vision_start|>")  # the 64 dropped tokens: the system turn
    with pytest.raises(ModelLoadError, match="QwenImageEditPlusPipeline, not a QwenImageEditPipeline"):
        get_family("qwen_image_edit").load(tiny_2511[0], max_sequence_length=64)


def test_the_source_is_read_at_384_and_encoded_at_1024_as_the_pipelines_encoding(family, sources):
    cond = family.encode_prompts(PROMPTS, sources)
    assert cond.image_latents.shape == (2, 4096, 16) and cond.source_grid == (64, 64)  # 1024² sources, VAE 8×
    assert family.source(sources[0], family.vl_area).size == (384, 384)
    plain = family.pipe.text_encoder
    try:
        family.pipe.text_encoder = WithImageMarks(plain)
        for i, (p, im) in enumerate(zip(PROMPTS, sources)):
            want, _ = family.pipe._get_qwen_prompt_embeds(p, [family.source(im, 384 * 384)], family.device)
            n = want.shape[1]
            # a padded row against the pipeline's unpadded one: float32 noise of the batch's shape,
            # 1.2e-7 on one machine and 1.3e-6 on another (2026-12-06); the parity bound
            assert (cond.prompt_embeds[i, :n] - want[0]).abs().max() <= 1e-5
    finally:
        family.pipe.text_encoder = plain
    edit = get_family("qwen_image_edit")  # Qwen-Image-Edit's reading of the same source differs
    assert edit.vl_area == 1024 * 1024 and edit.image_prompt == ""


# 2511 with and without CFG; 2509 (no zero_cond_t) under CFG, whose negative pass is its own path
@pytest.mark.parametrize("variant,cfg,negative", [("2511", 1.0, None), ("2511", 4.0, " "), ("2509", 4.0, " ")])
def test_ode_sampling_equals_the_pipeline(family, family_2509, sources, variant, cfg, negative):
    fam = family if variant == "2511" else family_2509
    cond = fam.encode_prompts(PROMPTS, sources)
    neg = row_negatives(fam, PROMPTS, sources, negative) if cfg > 1 else None
    recipe = SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=(), negative_prompt=negative or "")
    traj = sample(fam, cond, neg, gens([3, 4]), recipe)
    ref = edit_pipeline_latents(fam, cond, neg, [decode_rgb(im) for im in sources], cfg, [3, 4])  # it sizes both reads
    assert (fam.pipe._pack_latents(traj.final, 2, *fam.latent_shape()) - ref).abs().max().item() <= 1e-5
    other = sample(fam, fam.encode_prompts(PROMPTS, sources[::-1]), neg, gens([3, 4]), recipe)
    assert (other.final - traj.final).abs().max().item() > 1e-4  # the source reaches the velocity


def test_a_non_square_edit_equals_the_pipeline(tiny_2511, sources):
    """A 48×32 target: the pipeline given each source cropped to that aspect sizes both reads."""
    fam = wide(QwenImageEditPlusFamily, tiny_2511[0], 48, 32, max_sequence_length=64)
    cond = fam.encode_prompts(PROMPTS, sources)  # (CFG with each row's negative: the square tests)
    traj = sample(fam, cond, None, gens([3, 4]), SamplerRecipe(6, 0.0, train_steps=()))
    ref = edit_pipeline_latents(fam, cond, None, [crop_to_aspect(decode_rgb(im), 48, 32) for im in sources], 1.0,
                                [3, 4])
    assert (fam.pipe._pack_latents(traj.final, 2, *fam.latent_shape()) - ref).abs().max().item() <= 1e-5


def test_2511s_source_tokens_are_modulated_at_timestep_zero(family, family_2509, sources):
    """The same weights but the config flag give other velocities: the transformer reads it."""
    cond = family.encode_prompts(PROMPTS, sources)
    x = torch.randn(2, *family.latent_shape(), generator=torch.Generator().manual_seed(0))
    t = torch.tensor([500.0, 500.0])
    v = family.velocity(x, t, cond)
    family.transformer.zero_cond_t = False
    try:
        for block in family.transformer.transformer_blocks:
            block.zero_cond_t = False
        v_off = family.velocity(x, t, cond)
    finally:
        family.transformer.zero_cond_t = True
        for block in family.transformer.transformer_blocks:
            block.zero_cond_t = True
    assert (v - v_off).abs().max().item() > 1e-4


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, sources, sde_type, window):
    neg = row_negatives(family, PROMPTS, sources, " ")
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=4.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, sources), neg, recipe)


def test_two_rl_iterations_full_fine_tune_replay_and_generate(tiny_2511, tmp_path, prefect_harness):
    out, t = two_iterations(tiny_2511, tmp_path, "qiep", "full", "sampling.guidance_scale=4.0",
                            "sampling.negative_prompt=' '")
    assert t["source_image"].null_count == 0 and set(t["family"].to_pylist()) == {"qwen_image_edit_plus"}
    rep = CliRunner().invoke(app, ["replay", "qiep", "--iteration", "1", "--workdir", str(tmp_path)])
    assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output
    res = CliRunner().invoke(app, ["generate", "--run", "qiep", "--workdir", str(tmp_path), "--prompt", PROMPTS[0],
                                   "--image", str(tiny_2511[0] / "edits" / "source_0.png"),
                                   "--out", str(tmp_path / "gen"), "--steps", "2"])
    assert res.exit_code == 0, res.output
    assert Image.open(io.BytesIO((tmp_path / "gen" / "0000_00.png").read_bytes())).size == (32, 32)


def test_two_rl_iterations_lora(tiny_2511, tmp_path, prefect_harness):
    two_iterations(tiny_2511, tmp_path, "qiep_lora", "lora")


def test_the_presets_sample_as_the_model_card_says():
    from pixrl.config.loader import load_config

    for variant in ("2509", "2511"):
        cfg = load_config(None, [f"model=qwen_image_edit_{variant}", "model.path=/x"])
        assert cfg.model.family == "qwen_image_edit_plus" and cfg.model.dtype == "bfloat16"
    cfg = load_config("qwen_image_edit_2511_edit", ["model.path=/x"])
    assert (cfg.model.family, cfg.sampling.guidance_scale, cfg.sampling.negative_prompt) == ("qwen_image_edit_plus", 4.0, " ")
    assert cfg.algorithm.lora.enabled and cfg.algorithm.lora.rank == 64 and cfg.dataset.name == "edits"
