"""LTX-Video image-to-video on a tiny random checkpoint written by `pixrl tiny ltx_video_i2v` (the
LTXPipeline layout): the first-frame latents are the pipeline's normalisation of the source's
posterior mode, ODE latents equal LTXImageToVideoPipeline's given that condition (it samples the
posterior itself), with and without CFG, the first frame reaches the clip, the condition frame's
part of each transition carries no parameter, replayed log-probs equal the stored ones, and two
RL iterations through the unchanged flow (rows keep their frames; `pixrl replay` equal)."""

import io

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from conftest import two_iterations
from family_checks import (assert_needs_its_source_images, assert_final_frame_is_the_condition, assert_held_frame_is_parameter_free,
                           assert_replay_is_on_policy, assert_rows_keep_their_frames_and_replay, gens, wide)
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.artifacts.media import decode_media
from pixrl.cli import app
from pixrl.models.ltx_video_i2v import LTXVideoI2VFamily
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.source_images import source_pixels

PROMPTS = ["the red circle drifts to the right", "the camera zooms in"]


@pytest.fixture(scope="module")
def tiny_ltx_i2v(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-ltx-i2v"
    return out, LTXVideoI2VFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_ltx_i2v):
    return LTXVideoI2VFamily.load(tiny_ltx_i2v[0], max_sequence_length=32, resolution=64, frames=9,
                                  decode_timestep=0.03, decode_noise_scale=0.025)


@pytest.fixture(scope="module")
def frames(tiny_ltx_i2v):
    return [(tiny_ltx_i2v[0] / "first_frames" / f"frame_{i}.png").read_bytes() for i in range(2)]


def _pipeline(family, cond, negative, frames, cfg, seeds):
    """LTXImageToVideoPipeline on the checkpoint's components, one prompt and image a call, given
    the starting latents its `prepare_latents` would build from our condition: the condition in
    the first latent frame, the sample's noise in the rest (packed)."""
    from diffusers import LTXImageToVideoPipeline

    pipe = LTXImageToVideoPipeline(**family.pipe.components)
    pipe.set_progress_bar_config(disable=True)
    out = []
    for i, s in enumerate(seeds):
        start = torch.randn((1, *family.latent_shape()), generator=gens([s])[0])
        start[:, :, :1] = cond.condition[i:i + 1]
        res = pipe(image=source_pixels(family, frames[i], torch.float32)[0], prompt=[PROMPTS[i]], negative_prompt=negative,
                   guidance_scale=cfg, num_inference_steps=6, latents=pipe._pack_latents(start), output_type="latent",
                   height=family.height, width=family.width, num_frames=9, max_sequence_length=32).frames
        out.append(pipe._unpack_latents(res, *family.latent_shape()[1:]))
    return torch.cat(out)


def test_registered_and_selected_by_name(tiny_ltx_i2v, family):
    assert get_family("ltx_video_i2v") is LTXVideoI2VFamily and LTXVideoI2VFamily.needs_images
    assert family_of_directory(tiny_ltx_i2v[0]) == "ltx_video"  # the released layout: text-to-video by default
    assert family.latent_shape() == (8, 3, 4, 4)


def test_first_frame_latents_normalise_the_sources_posterior_mode(family, frames):
    cond = family.encode_prompts(PROMPTS, frames)
    picture = Image.open(io.BytesIO(frames[0])).convert("RGB")
    pixels = family.pipe.video_processor.preprocess(picture, height=64, width=64)
    dist = family.vae.encode(pixels.unsqueeze(2)).latent_dist
    want = (dist.mode() - family.vae.latents_mean.view(1, -1, 1, 1, 1)) / family.vae.latents_std.view(1, -1, 1, 1, 1)
    assert cond.condition.shape == (2, 8, 1, 4, 4) and torch.allclose(cond.condition[:1], want, atol=1e-6)


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (3.0, None), (3.0, "worst quality, blurry")])
def test_ode_sampling_equals_the_image_to_video_pipeline(family, frames, cfg, negative):
    cond = family.encode_prompts(PROMPTS, frames)
    neg = family.encode_negative(negative or "").expand(2) if cfg > 1 else None
    ref = _pipeline(family, cond, negative, frames, cfg, [3, 4])
    traj = sample(family, cond, neg, gens([3, 4]), SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    other = sample(family, family.encode_prompts(PROMPTS, frames[::-1]), neg, gens([3, 4]),
                   SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 8, 3, 4, 4)
    assert (traj.final - ref).abs().max().item() <= 1e-5
    assert (other.final[:, :, 1:] - traj.final[:, :, 1:]).abs().max().item() > 1e-4  # the frame reaches the clip


def test_non_square_ode_equals_the_image_to_video_pipeline(tiny_ltx_i2v, frames):
    fam = wide(LTXVideoI2VFamily, tiny_ltx_i2v[0], 64, 96, max_sequence_length=32, frames=9, decode_timestep=0.03,
               decode_noise_scale=0.025)
    cond, neg = fam.encode_prompts(PROMPTS, frames), fam.encode_negative("").expand(2)
    ref = _pipeline(fam, cond, None, frames, 3.0, [3, 4])
    traj = sample(fam, cond, neg, gens([3, 4]), SamplerRecipe(6, 0.0, guidance_scale=3.0, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 8, 3, 4, 6)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_a_stochastic_last_step_ends_on_the_condition_frame(family, frames):
    cond, neg = family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2)
    assert_final_frame_is_the_condition(family, cond, neg, 3.0)


def test_the_condition_frames_transition_carries_no_parameter(family, frames):
    cond, neg = family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2)
    assert_held_frame_is_parameter_free(family, cond, neg, 3.0, 0.5)


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, frames, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=3.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2),
                               recipe)


def test_refusals_name_the_fix(family):
    assert_needs_its_source_images(family, PROMPTS, 900.0)


def test_two_rl_iterations_through_the_unchanged_flow(tiny_ltx_i2v, tmp_path, prefect_harness):
    out, t = two_iterations(tiny_ltx_i2v, tmp_path, "ltx-i2v", "full", "sampling.guidance_scale=3.0")
    folder = tiny_ltx_i2v[0] / "first_frames"
    assert decode_media(t["image"][0].as_py()).shape == (9, 64, 64, 3)
    assert_rows_keep_their_frames_and_replay(folder / "prompts.jsonl", t, "ltx-i2v", tmp_path)
    res = CliRunner().invoke(app, ["generate", "--run", "ltx-i2v", "--workdir", str(tmp_path), "--prompt", PROMPTS[0],
                                   "--image", str(folder / "frame_0.png"), "--out", str(tmp_path / "gen"),
                                   "--steps", "2"])
    assert res.exit_code == 0, res.output
    (clip,) = sorted((tmp_path / "gen").glob("*.png"))  # the trained policy animates a frame
    assert decode_media(clip.read_bytes()).shape == (9, 64, 64, 3)


def test_the_presets():
    from pixrl.config.loader import load_config

    cfg = load_config("ltx_video_i2v_video", ["model.path=/x", "dataset.path=/x.jsonl"])
    assert (cfg.model.family, cfg.model.size(), cfg.model.frames) == ("ltx_video_i2v", (512, 704), 65)
    assert cfg.dataset.name == "edits" and cfg.model.decode_timestep == 0.03
