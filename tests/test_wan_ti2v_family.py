"""Wan2.2-TI2V-5B image-to-video on a tiny random checkpoint written by `pixrl tiny wan_ti2v` (the
WanPipeline layout with `expand_timesteps` and the 5B's residual, patchified VAE): the first-frame
latents equal WanImageToVideoPipeline's, ODE latents equal that pipeline's (run on the same
components) with and without CFG, the first frame reaches the clip, the condition frame's part of
each transition carries no parameter, replayed log-probs equal the stored ones, the refusals, and
two RL iterations through the unchanged flow (rows keep their first frames; `pixrl replay` equal)."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from conftest import two_iterations
from family_checks import (assert_needs_its_source_images, assert_final_frame_is_the_condition, assert_held_frame_is_parameter_free,
                           assert_replay_is_on_policy, euler, gens, wide)
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.artifacts.media import decode_media
from pixrl.cli import app
from pixrl.models.base import ModelLoadError
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.source_images import source_pixels
from pixrl.models.wan import WanFamily
from pixrl.models.wan_ti2v import WanTI2VFamily

PROMPTS = ["the red circle drifts to the right", "the camera zooms in"]


@pytest.fixture(scope="module")
def tiny_ti2v(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-wan22-ti2v"
    return out, WanTI2VFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_ti2v):
    return WanTI2VFamily.load(tiny_ti2v[0], max_sequence_length=64, resolution=32, frames=5)


@pytest.fixture(scope="module")
def frames(tiny_ti2v):
    return [(tiny_ti2v[0] / "first_frames" / f"frame_{i}.png").read_bytes() for i in range(2)]


def _i2v_pipeline(family):
    """WanImageToVideoPipeline on the checkpoint's own components (the 5B ships no image encoder)."""
    from diffusers import WanImageToVideoPipeline

    parts = {k: v for k, v in family.pipe.components.items() if k in ("tokenizer", "text_encoder", "vae", "scheduler",
                                                                      "transformer")}
    pipe = WanImageToVideoPipeline(**parts, image_encoder=None, image_processor=None, expand_timesteps=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline(family, cond, negative, frames, cfg, seeds, output_type="latent"):
    pipe = _i2v_pipeline(family)
    out = [pipe(image=source_pixels(family, frames[i], torch.float32)[0], prompt_embeds=cond.prompt_embeds[i:i + 1],
                negative_prompt=negative, guidance_scale=cfg, num_inference_steps=6, generator=gens([s]),
                output_type=output_type, height=family.height, width=family.width, num_frames=5,
                max_sequence_length=64).frames
           for i, s in enumerate(seeds)]
    return torch.cat(out) if output_type == "latent" else np.concatenate(out)


def test_registered_and_selected_by_name(tiny_ti2v, family):
    assert get_family("wan_ti2v") is WanTI2VFamily and WanTI2VFamily.video and WanTI2VFamily.needs_images
    assert family_of_directory(tiny_ti2v[0]) == "wan"  # the released layout is WanPipeline: text-to-video by default
    assert family.latent_shape() == (4, 3, 4, 4) and family.pipe.config.expand_timesteps


def test_first_frame_latents_are_the_pipelines(family, frames):
    cond = family.encode_prompts(PROMPTS, frames)
    pipe = _i2v_pipeline(family)
    for i, im in enumerate(frames):
        picture = Image.open(io.BytesIO(im)).convert("RGB")
        pixels = pipe.video_processor.preprocess(picture, height=32, width=32).to(torch.float32)
        _, want, mask = pipe.prepare_latents(pixels, 1, 4, 32, 32, 5, torch.float32, "cpu", gens([0]))
        assert torch.equal(cond.condition[i:i + 1], want)
    assert cond.condition.shape == (2, 4, 1, 4, 4) and mask[:, :, 0].eq(0).all() and mask[:, :, 1:].eq(1).all()


def test_non_square_ode_equals_the_image_to_video_pipeline(tiny_ti2v, frames):
    fam = wide(WanTI2VFamily, tiny_ti2v[0], 48, 32, max_sequence_length=64, frames=5)
    cond, neg = fam.encode_prompts(PROMPTS, frames), fam.encode_negative("").expand(2)
    with euler(fam):
        ref = _pipeline(fam, cond, "", frames, 5.0, [3, 4])
        traj = sample(fam, cond, neg, gens([3, 4]), SamplerRecipe(6, 0.0, guidance_scale=5.0, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 3, 6, 4)
    assert (traj.final - ref).abs().max().item() <= 1e-5
    assert torch.allclose(traj.final[:, :, :1], cond.condition, atol=1e-6)


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (5.0, ""), (5.0, "blurry, static")])
def test_ode_sampling_equals_the_image_to_video_pipeline(family, frames, cfg, negative):
    cond = family.encode_prompts(PROMPTS, frames)
    neg = family.encode_negative(negative).expand(2) if cfg > 1 else None
    with euler(family):
        ref = _pipeline(family, cond, negative, frames, cfg, [3, 4])
        traj = sample(family, cond, neg, gens([3, 4]), SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
        other = sample(family, family.encode_prompts(PROMPTS, frames[::-1]), neg, gens([3, 4]),
                       SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 3, 4, 4)
    assert (traj.final - ref).abs().max().item() <= 1e-5
    assert torch.allclose(traj.final[:, :, :1], cond.condition, atol=1e-6)  # Euler lands on the condition
    assert (other.final[:, :, 1:] - traj.final[:, :, 1:]).abs().max().item() > 1e-4  # it reaches the clip


def test_decoded_clips_equal_the_pipeline_frames(family, frames):
    cond = family.encode_prompts(PROMPTS, frames)
    with euler(family):
        ref = _pipeline(family, cond, "", frames, 5.0, [5, 6], "np")
        traj = sample(family, cond, family.encode_negative("").expand(2), gens([5, 6]),
                      SamplerRecipe(6, 0.0, guidance_scale=5.0, train_steps=()))
    clips = family.decode(traj.final)
    assert clips.shape == (2, 5, 32, 32, 3)
    assert np.abs(clips.astype(int) - (np.asarray(ref) * 255).round().astype(int)).max() <= 1


def test_a_stochastic_last_step_ends_on_the_condition_frame(family, frames):
    cond, neg = family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2)
    assert_final_frame_is_the_condition(family, cond, neg, 5.0)


def test_the_condition_frames_transition_carries_no_parameter(family, frames):
    """Its velocity is (x − c)/σ whatever the weights: the log-prob's gradient reaches only the
    generated frames' outputs, and the condition frame's v is the one towards c."""
    cond, neg = family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2)
    assert_held_frame_is_parameter_free(family, cond, neg, 5.0, 0.6)


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, frames, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=5.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2),
                               recipe)


def test_refusals_name_the_fix(family, tmp_path_factory):
    assert_needs_its_source_images(family, PROMPTS, 900.0)
    t2v = tmp_path_factory.mktemp("ckpt") / "wan21"
    WanFamily.write_tiny(t2v, seed=0)
    with pytest.raises(ModelLoadError, match="Wan2.2-TI2V-5B.*model.family=wan.*model.family=wan_i2v"):
        WanTI2VFamily.load(t2v, max_sequence_length=64, resolution=32, frames=5)


def test_two_rl_iterations_through_the_unchanged_flow(tiny_ti2v, tmp_path, prefect_harness):
    """Full fine-tuning; rows keep their first frames; `pixrl replay` of iteration 1 is exact."""
    out, t = two_iterations(tiny_ti2v, tmp_path, "ti2v", "full", "sampling.guidance_scale=5.0")
    folder = tiny_ti2v[0] / "first_frames"
    files = {json.loads(ln)["prompt"]: (folder / json.loads(ln)["image"]).read_bytes()
             for ln in (folder / "prompts.jsonl").read_text().splitlines()}
    assert all(img == files[p] for p, img in zip(t["prompt"].to_pylist(), t["source_image"].to_pylist()))
    assert decode_media(t["image"][0].as_py()).shape == (5, 32, 32, 3)
    rep = CliRunner().invoke(app, ["replay", "ti2v", "--iteration", "1", "--workdir", str(tmp_path)])
    assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output
    res = CliRunner().invoke(app, ["generate", "--run", "ti2v", "--workdir", str(tmp_path), "--prompt", PROMPTS[0],
                                   "--image", str(folder / "frame_0.png"), "--out", str(tmp_path / "gen"),
                                   "--steps", "2"])
    assert res.exit_code == 0, res.output
    (clip,) = sorted((tmp_path / "gen").glob("*.png"))  # the trained policy animates a frame
    assert decode_media(clip.read_bytes()).shape == (5, 32, 32, 3)


def test_the_presets():
    from pixrl.config.loader import load_config

    cfg = load_config("wan22_ti2v_5b_i2v_video", ["model.path=/x", "dataset.path=/x.jsonl"])
    assert (cfg.model.family, cfg.model.size(), cfg.model.frames) == ("wan_ti2v", (704, 1280), 49)
    assert cfg.dataset.name == "edits" and cfg.algorithm.lora.enabled
