"""Cosmos-Predict2 Video2World given one image, on a tiny random checkpoint written by `pixrl tiny
cosmos2_v2w`: the first latent frame is the pipeline's normalisation of the source's posterior
mode (the causal VAE's first frame, whatever the pipeline pads after it), ODE latents equal
Cosmos2VideoToWorldPipeline's given that condition (it samples the posterior itself) with and
without CFG, the condition frame's part of each transition carries no parameter, replayed
log-probs equal the stored ones, and two RL iterations through the unchanged flow."""

from unittest import mock

import pytest
import torch

from conftest import two_iterations
from family_checks import (assert_needs_its_source_images, PassingGuardrail, assert_held_frame_is_parameter_free, assert_replay_is_on_policy,
                           assert_rows_keep_their_frames_and_replay, gens, wide)
from pixrl.algorithms.sampling import SamplerRecipe, initial_noise, sample
from pixrl.artifacts.media import decode_media
from pixrl.models.cosmos2_v2w import Cosmos2Video2WorldFamily
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.source_images import source_pixels

PROMPTS = ["the red circle drifts to the right", "the camera zooms in"]


@pytest.fixture(scope="module")
def tiny_v2w(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-cosmos2-v2w"
    return out, Cosmos2Video2WorldFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_v2w):
    return Cosmos2Video2WorldFamily.load(tiny_v2w[0], max_sequence_length=64, resolution=32, frames=5)


@pytest.fixture(scope="module")
def frames(tiny_v2w):
    return [(tiny_v2w[0] / "first_frames" / f"frame_{i}.png").read_bytes() for i in range(2)]


def _pipeline(family, frames, cfg: float, seeds, negative: str = "", steps: int = 6, fps: int = 16):
    """Cosmos2VideoToWorldPipeline one prompt and image a call, given our initial noise and its
    VAE posterior read at the mode (the condition pixrl encodes): it pads the image to the whole
    clip and encodes that."""
    import diffusers.pipelines.cosmos.pipeline_cosmos2_video2world as module

    shipped = module.retrieve_latents

    def at_mode(encoder_output, generator=None, sample_mode="sample"):
        return shipped(encoder_output, generator, "argmax")

    out = []
    family.pipe.safety_checker = PassingGuardrail()
    try:
        for i, seed in enumerate(seeds):
            picture, _ = source_pixels(family, frames[i], torch.float32)
            noise = initial_noise(gens([seed]), family.latent_shape())
            with mock.patch.object(module, "retrieve_latents", at_mode):
                out.append(family.pipe(image=picture, prompt=PROMPTS[i], negative_prompt=negative,
                                       guidance_scale=cfg - 1.0, num_inference_steps=steps, latents=noise,
                                       output_type="latent", height=family.height, width=family.width,
                                       num_frames=family.frames, max_sequence_length=64, fps=fps).frames)
    finally:
        family.pipe.safety_checker = None
    return torch.cat(out)


def test_registered_and_found_from_its_layout(tiny_v2w, family):
    assert get_family("cosmos2_v2w") is Cosmos2Video2WorldFamily and family_of_directory(tiny_v2w[0]) == "cosmos2_v2w"
    assert family.latent_shape() == (4, 3, 8, 8) and family.fps == 16 and family.describe()["frames"] == 5


def test_the_condition_is_the_normalised_posterior_mode_of_the_source(family, frames):
    cond = family.encode_prompts(PROMPTS, frames)
    _, pixels = source_pixels(family, frames[0], torch.float32)
    cfg = family.vae.config
    z = family.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (cfg.latents_mean, cfg.latents_std))
    assert cond.condition.shape == (2, 4, 1, 8, 8) and torch.equal(cond.condition[:1], (z - mean) / std)
    assert not torch.equal(cond.condition[0], cond.condition[1])


@pytest.mark.parametrize("cfg,negative", [(1.0, ""), (8.0, ""), (4.0, "blurry, low quality")])
def test_ode_sampling_equals_the_video2world_pipeline(family, frames, cfg, negative):
    ref = _pipeline(family, frames, cfg, [3, 4], negative)
    neg = family.encode_negative(negative).expand(2) if cfg > 1 else None
    traj = sample(family, family.encode_prompts(PROMPTS, frames), neg, gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 3, 8, 8)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_non_square_ode_and_another_frame_rate_equal_the_pipeline(tiny_v2w, frames):
    fam = wide(Cosmos2Video2WorldFamily, tiny_v2w[0], 32, 48, max_sequence_length=64, frames=5, frame_rate=10)
    neg = fam.encode_negative("").expand(2)
    traj = sample(fam, fam.encode_prompts(PROMPTS, frames), neg, gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=8.0, train_steps=()))
    ref = _pipeline(fam, frames, 8.0, [3, 4], fps=10)
    assert traj.final.shape == ref.shape == (2, 4, 3, 8, 12)
    assert (traj.final - ref).abs().max().item() <= 1e-5
    at16 = _pipeline(fam, frames, 8.0, [3, 4])
    assert (at16 - ref).abs().max().item() > 1e-4  # the frame rate reaches the rotary time


def test_the_condition_frames_transition_carries_no_parameter(family, frames):
    cond, neg = family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2)
    assert_held_frame_is_parameter_free(family, cond, neg, 8.0, 0.5, per_thousand=False)


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", (0, 1, 2, 3)), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, frames, sde_type, window):
    recipe = SamplerRecipe(steps=6, noise_level=0.7, sde_type=sde_type, guidance_scale=8.0, sde_steps=window,
                           train_steps=window or (0, 1, 2, 3, 4))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2),
                               recipe)


def test_refusals_name_the_fix(family):
    assert_needs_its_source_images(family, PROMPTS, 0.9)


def test_two_rl_iterations_through_the_unchanged_flow(tiny_v2w, tmp_path, prefect_harness):
    out, t = two_iterations(tiny_v2w, tmp_path, "cosmos-v2w", "lora", "sampling.guidance_scale=8.0")
    assert decode_media(t["image"][0].as_py()).shape == (5, 32, 32, 3)
    assert_rows_keep_their_frames_and_replay(tiny_v2w[0] / "first_frames" / "prompts.jsonl", t, "cosmos-v2w", tmp_path)


def test_the_presets(tiny_v2w):
    from pixrl.config.loader import load_config

    cfg = load_config("cosmos2_v2w_video", ["model.path=/x", "dataset.path=/x.jsonl"])
    assert (cfg.model.family, cfg.model.size(), cfg.model.frames, cfg.model.frame_rate) == ("cosmos2_v2w", (480, 832),
                                                                                            33, 16)
    assert cfg.dataset.name == "edits" and cfg.sampling.guidance_scale == 8.0 and cfg.algorithm.lora.rank == 64
    Cosmos2Video2WorldFamily.check_options(tiny_v2w[0], {}, cfg.sampling)
