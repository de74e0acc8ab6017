"""Qwen-Image-2.1 on a tiny random checkpoint written by `pixrl tiny qwen_image21` (the released
layout: QwenImage21Pipeline with a Qwen3-VL text encoder, its processor's files, the 16× RGBA VAE
and the single-stream DiT): the prompt encoding is the pipeline's (the last decoder layer before
the final norm, left padding, the system turn dropped), ODE latents equal QwenImage21Pipeline's
with and without true CFG and with and without its prefix KV cache, the checkpoint's
sample_sigmas are honoured, the decode composites alpha over white, replay is exact, and two RL
iterations run through the unchanged flow (LoRA and full fine-tuning, the latter replayed). Edits:
each prompt's source read by Qwen3-VL in the edit template and by the VAE with its alpha, ODE
latents equal the pipeline's with that one condition image under true CFG whose negative is read
with the source, replay exact, a mixed set refused, two iterations of edits through the flow."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens, row_negatives, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.cli import app
from pixrl.models.base import ModelLoadError
from pixrl.models.qwen_image21 import QwenImage21Family
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.source_images import SourceImageError, decode_rgb, png_bytes

PROMPTS = ["a red circle", "two blue squares on the left of a green triangle"]


@pytest.fixture(scope="module")
def tiny_q21(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-qwen_image21"
    return out, QwenImage21Family.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_q21):
    return QwenImage21Family.load(tiny_q21[0], max_sequence_length=64, resolution=64)


def test_registered_and_found_from_its_layout(tiny_q21, family):
    assert get_family("qwen_image21") is QwenImage21Family and family_of_directory(tiny_q21[0]) == "qwen_image21"
    index = json.loads((tiny_q21[0] / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "Qwen3VLProcessor"] and family.latent_shape() == (4, 4, 4)
    with pytest.raises(ModelLoadError, match="QwenImage21Pipeline, not a QwenImagePipeline"):
        get_family("qwen_image").load(tiny_q21[0], max_sequence_length=64)


def test_prompts_are_encoded_before_the_final_norm_with_the_system_turn_dropped(family):
    cond = family.encode_prompts(PROMPTS)
    want, mask, pads = family.pipe.encode_prompt(PROMPTS, device=family.device)
    assert torch.equal(cond.prompt_embeds, want) and torch.equal(cond.mask, mask) and not cond.image_pad_mask.any()
    assert cond.mask[0].sum() < cond.mask[1].sum()  # padded, and masked
    proc = family.pipe.processor
    enc = proc(text=[family.pipe.prompt_template_t2i.format(PROMPTS[1])], return_tensors="pt")
    with torch.no_grad():
        normed = family.pipe.text_encoder.model(**{k: enc[k] for k in ("input_ids", "attention_mask")}).last_hidden_state
    drop = family.pipe._drop_idx
    assert proc.tokenizer.decode(enc["input_ids"][0, drop:]).startswith("<|im_start|>user\n" + PROMPTS[1])
    assert (normed[0, drop:] - cond.prompt_embeds[1]).abs().max() > 1e-3  # the norm is not applied


def _pipeline(family, cfg, negative, seeds, steps=6, cache=False):
    """The pipeline one prompt a call: batched, it would place a shorter prompt's target tokens
    after its padding (the family runs each row as alone, whatever its batch)."""
    return torch.cat([family.pipe(prompt=[p], negative_prompt=None if negative is None else [negative],
                                  true_cfg_scale=cfg, height=family.height, width=family.width,
                                  num_inference_steps=steps,
                                  generator=gens([s]), output_type="latent", use_kv_cache=cache).images
                      for p, s in zip(PROMPTS, seeds)])


def _packed(x):
    b, c, h, w = x.shape
    return x.reshape(b, c, h * w).transpose(1, 2)


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (4.0, " "), (4.0, "blurry, low quality")])
def test_ode_sampling_equals_the_pipeline(family, cfg, negative):
    cond = family.encode_prompts(PROMPTS)
    neg = family.encode_negative(negative) if cfg > 1 else None
    recipe = SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=(), negative_prompt=negative or "")
    traj = sample(family, cond, neg, gens([3, 4]), recipe)
    for cache in (False, True):  # its prefix KV cache changes nothing but speed
        ref = _pipeline(family, cfg, negative, [3, 4], cache=cache)
        assert (_packed(traj.final) - ref).abs().max().item() <= 1e-5
    other = sample(family, family.encode_prompts(PROMPTS[::-1]), neg, gens([3, 4]), recipe)
    assert (other.final - traj.final).abs().max().item() > 1e-4
    alone = sample(family, family.encode_prompts(PROMPTS[:1]), neg, gens([3]), recipe)  # its batch changes nothing
    assert (alone.final[0] - traj.final[0]).abs().max().item() <= 1e-5


def test_the_checkpoints_sample_sigmas_set_the_grid_when_the_step_count_matches(family):
    plain, _ = family.schedule(4)
    family.pipe.register_to_config(sample_sigmas=[1.0, 0.9, 0.6, 0.25])
    try:
        given, _ = family.schedule(4)
        recipe = SamplerRecipe(4, 0.0, guidance_scale=1.0, train_steps=())
        traj = sample(family, family.encode_prompts(PROMPTS), None, gens([5, 6]), recipe)
        assert (_packed(traj.final) - _pipeline(family, 1.0, None, [5, 6], steps=4)).abs().max().item() <= 1e-5
        other, _ = family.schedule(5)  # another count than the checkpoint's: the pipeline's linspace
    finally:
        family.pipe.register_to_config(sample_sigmas=None)
    assert not torch.allclose(given, plain) and torch.equal(other, family.schedule(5)[0])


def test_non_square_ode_equals_the_pipeline(tiny_q21):
    fam = wide(QwenImage21Family, tiny_q21[0], 64, 32, max_sequence_length=64)
    traj = sample(fam, fam.encode_prompts(PROMPTS), None, gens([3, 4]), SamplerRecipe(6, 0.0, train_steps=()))
    ref = _pipeline(fam, 1.0, None, [3, 4])
    assert traj.final.shape[-2:] == (2 * traj.final.shape[-1], traj.final.shape[-1])
    assert (_packed(traj.final) - ref).abs().max().item() <= 1e-5


def test_decode_is_the_pipelines_with_alpha_over_white(family):
    latents = torch.randn(2, *family.latent_shape(), generator=torch.Generator().manual_seed(0))
    got = family.decode(latents)
    cfg = family.vae.config
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        rgba = family.vae.decode(latents.unsqueeze(2) * std + mean, return_dict=False)[0][:, :, 0]
    rgba = family.pipe.image_processor.postprocess(rgba, output_type="np")  # [B, H, W, 4] in [0, 1]
    want = np.round((rgba[..., :3] * rgba[..., 3:] + (1 - rgba[..., 3:])) * 255).astype(np.uint8)
    assert got.shape == (2, 64, 64, 3) and np.abs(got.astype(int) - want.astype(int)).max() <= 1


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=4.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative(" "), recipe)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_rl_iterations_through_the_unchanged_flow(tiny_q21, tmp_path, prefect_harness, mode):
    two_iterations(tiny_q21, tmp_path, f"q21_{mode}", mode, "sampling.guidance_scale=4.0",
                   "sampling.negative_prompt=' '")
    if mode == "full":
        rep = CliRunner().invoke(app, ["replay", f"q21_{mode}", "--iteration", "1", "--workdir", str(tmp_path)])
        assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output


def test_the_presets():
    from pixrl.config.loader import load_config

    cfg = load_config("qwen_image21_geneval", ["model.path=/x"])
    assert (cfg.model.family, cfg.model.resolution, cfg.sampling.guidance_scale) == ("qwen_image21", 512, 4.0)
    assert cfg.algorithm.lora.enabled and cfg.algorithm.lora.rank == 64


@pytest.fixture(scope="module")
def sources(family):
    rng = np.random.default_rng(3)
    return [png_bytes(rng.integers(0, 256, (48, 48, 3))) for _ in PROMPTS]


def test_an_edit_reads_its_source_in_the_template_and_through_the_vae(family, sources):
    cond = family.encode_prompts(PROMPTS, sources)
    assert cond.image_latents.shape == (2, 16, 4) and cond.source_grid == (4, 4)  # 64² at 16×
    assert cond.image_pad_mask.sum(1).tolist() == [4, 4]  # each slot four of those tokens
    for i, (p, src) in enumerate(zip(PROMPTS, sources)):  # each row as the pipeline encodes it alone
        want, _, pads = family.pipe._get_qwen_prompt_embeds([p], [family.source(src)], family.device)
        n = want.shape[1]
        assert torch.equal(cond.prompt_embeds[i, :n], want[0]) and torch.equal(cond.image_pad_mask[i, :n], pads[0])
    assert family.source(sources[0]).mode == "RGBA"  # the VAE reads four channels
    with pytest.raises(SourceImageError, match="mix edits"):
        family.encode_prompts(PROMPTS, [sources[0], None])


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (4.0, " ")])
def test_an_edit_equals_the_pipeline_with_one_condition_image(family, sources, cfg, negative):
    cond = family.encode_prompts(PROMPTS, sources)
    neg = row_negatives(family, PROMPTS, sources, negative) if cfg > 1 else None
    recipe = SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=(), negative_prompt=negative or "")
    traj = sample(family, cond, neg, gens([3, 4]), recipe)
    for i, (p, src, seed) in enumerate(zip(PROMPTS, sources, [3, 4])):  # the pipeline: one condition image a call
        ref = family.pipe(prompt=[p], image=[decode_rgb(src)], negative_prompt=None if negative is None else [negative],
                          true_cfg_scale=cfg, height=64, width=64, output_resolution=64, num_inference_steps=6,
                          generator=gens([seed]), output_type="latent", use_kv_cache=False).images
        assert (_packed(traj.final[i:i + 1]) - ref).abs().max().item() <= 1e-5
    text = sample(family, family.encode_prompts(PROMPTS), neg if neg is None else family.encode_negative(negative),
                  gens([3, 4]), recipe)
    assert (text.final - traj.final).abs().max().item() > 1e-4  # the source reaches the velocity


def test_edits_replay_exactly(family, sources):
    neg = row_negatives(family, PROMPTS, sources, " ")
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type="sde", guidance_scale=4.0, train_steps=(0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, sources), neg, recipe)


def test_two_iterations_of_edits_through_the_flow(tiny_q21, tmp_path, prefect_harness):
    from pixrl.models.flux_kontext import write_edit_prompts

    edits = write_edit_prompts(tmp_path / "edits", seed=2)
    out, t = two_iterations(tiny_q21, tmp_path, "q21_edit", "lora", "sampling.guidance_scale=4.0",
                            "sampling.negative_prompt=' '", "dataset=edits", f"dataset.path={edits}")
    assert t["source_image"].null_count == 0


def test_held_out_evaluation_samples_text_to_image_with_one_negative(family):
    """A family that reads an edit's negative with its source evaluates text prompts with the one
    encoding of the negative (the evaluation path, not only rollouts)."""
    from pixrl.datasets.shapes.evaluate import generate_images

    recipe = SamplerRecipe(4, 0.0, guidance_scale=4.0, train_steps=(), negative_prompt=" ")
    imgs = generate_images(family, PROMPTS, [1, 2], recipe)
    assert imgs.shape == (2, 64, 64, 3)


def test_a_source_the_image_processor_shrinks_is_refused_naming_the_fix(family, sources):
    ip = family.pipe.processor.image_processor
    kept = ip.size
    ip.size = type(kept)(shortest_edge=32 * 32, longest_edge=32 * 32)
    try:
        with pytest.raises(SourceImageError, match="max_pixels .* is below 4096; lower model.resolution"):
            family.encode_prompts(PROMPTS, sources)
    finally:
        ip.size = kept
