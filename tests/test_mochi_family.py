"""Mochi 1 text-to-video on a tiny random checkpoint written by `pixrl tiny mochi` in the diffusers
layout: the T5 encoding with its mask (an empty prompt zeroed, each prompt on its own), the
pipeline's linear-quadratic σ list through the inverted scheduler, ODE latents equal to
MochiPipeline's with and without CFG, decoded clips equal to its frames, replayed log-probs equal
the stored ones, the refusals, and two RL iterations (LoRA and full) through the unchanged flow."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.artifacts.media import decode_media
from pixrl.cli import app
from pixrl.models.base import ModelLoadError
from pixrl.models.mochi import THRESHOLD_NOISE, MochiFamily
from pixrl.models.registry import family_of_directory, get_family

PROMPTS = ["a red circle", "two blue squares in the sky"]


@pytest.fixture(scope="module")
def tiny_mochi(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-mochi"
    return out, MochiFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_mochi):
    return MochiFamily.load(tiny_mochi[0], max_sequence_length=32, resolution=32, frames=7)


def _pipeline(family, cfg: float, seeds, output_type: str, negative: str | None = None):
    """The pipeline one prompt a call (its VAE decodes a clip at a time in pixrl too)."""
    out = [family.pipe(prompt=[p], negative_prompt=negative, num_inference_steps=6, guidance_scale=cfg,
                       generator=gens([s]), output_type=output_type, height=family.height, width=family.width, num_frames=7,
                       max_sequence_length=32).frames for p, s in zip(PROMPTS, seeds)]
    return torch.cat(out) if output_type == "latent" else np.concatenate(out)


def test_registered_and_found_from_its_layout(tiny_mochi, family):
    assert get_family("mochi") is MochiFamily and MochiFamily.video
    assert family_of_directory(tiny_mochi[0]) == "mochi"
    assert family.latent_shape() == (12, 2, 4, 4)  # 7 frames → (7−1)/6 + 1; 32 px / 8
    names = [n for n, _ in family.transformer.named_modules()]
    assert all(any(n.endswith(t) for n in names) for t in MochiFamily.lora_targets)
    assert family.inverted and family.describe()["force_zeros_for_empty_prompt"] is True


def test_encoding_is_the_pipelines_one_prompt_at_a_time(family):
    cond = family.encode_prompts(PROMPTS + [""])
    ref, mask, _, _ = family.pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=32,
                                                device="cpu")
    assert torch.equal(cond.prompt_embeds[:2], ref) and torch.equal(cond.mask[:2], mask)
    empty, empty_mask, _, _ = family.pipe.encode_prompt([""], do_classifier_free_guidance=False,
                                                        max_sequence_length=32, device="cpu")
    assert torch.equal(cond.prompt_embeds[2:], empty) and not empty_mask.any() and not cond.mask[2].any()
    # the pipeline, given the empty prompt last in a batch, zeroes every prompt of it; pixrl does not
    batch, batch_mask, _, _ = family.pipe.encode_prompt(PROMPTS + [""], do_classifier_free_guidance=False,
                                                        max_sequence_length=32, device="cpu")
    assert not batch_mask.any() and cond.mask[0].any()


def test_schedule_is_the_pipelines_linear_quadratic_list_inverted_back(family):
    from copy import deepcopy

    from diffusers.pipelines.mochi.pipeline_mochi import linear_quadratic_schedule

    sigmas, timesteps = family.schedule(6)
    ref = linear_quadratic_schedule(6, THRESHOLD_NOISE)
    sched = deepcopy(family.pipe.scheduler)
    sched.set_timesteps(sigmas=np.array(ref))
    assert torch.equal(timesteps, sched.timesteps.float())  # the transformer's t: (1 − σ)·1000
    assert torch.allclose(sigmas[:-1], torch.tensor(ref, dtype=torch.float32), atol=1e-6)
    assert sigmas[0] == 1 and sigmas[-1] == 0 and torch.all(sigmas[1:] < sigmas[:-1])
    assert float(timesteps[0]) == 0.0  # pure noise is the transformer's time 0


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (4.5, None), (4.5, "blurry, static")])
def test_ode_sampling_equals_the_pipeline(family, cfg, negative):
    ref = _pipeline(family, cfg, [3, 4], "latent", negative)
    neg = family.encode_negative(negative or "").expand(2) if cfg > 1 else None
    traj = sample(family, family.encode_prompts(PROMPTS), neg, gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 12, 2, 4, 4)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_non_square_ode_equals_the_pipeline(tiny_mochi):
    fam = wide(MochiFamily, tiny_mochi[0], 32, 48, max_sequence_length=32, frames=7)
    ref = _pipeline(fam, 4.5, [3, 4], "latent")
    traj = sample(fam, fam.encode_prompts(PROMPTS), fam.encode_negative("").expand(2), gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=4.5, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 12, 2, 4, 6)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_decoded_clips_equal_the_pipeline_frames(family):
    ref = _pipeline(family, 4.5, [5, 6], "np")
    traj = sample(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), gens([5, 6]),
                  SamplerRecipe(6, 0.0, guidance_scale=4.5, train_steps=()))
    clips = family.decode(traj.final)
    assert clips.shape == (2, 7, 32, 32, 3) and clips.dtype == np.uint8
    assert np.abs(clips.astype(int) - (np.asarray(ref) * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=4.5, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_refusals_name_the_fix(tiny_mochi):
    path = tiny_mochi[0]
    with pytest.raises(ModelLoadError, match="model.frames=8.*6k\\+1 frames"):
        MochiFamily.load(path, max_sequence_length=32, resolution=32, frames=8)
    with pytest.raises(ModelLoadError, match="model.resolution=40.*multiple of 16"):
        MochiFamily.load(path, max_sequence_length=32, resolution=40, frames=7)
    with pytest.raises(ModelLoadError, match="model.max_sequence_length=300.*1–256"):
        MochiFamily.load(path, max_sequence_length=300, resolution=32, frames=7)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_rl_iterations_through_the_unchanged_flow(tiny_mochi, tmp_path, prefect_harness, mode):
    out, t = two_iterations(tiny_mochi, tmp_path, f"mochi-{mode}", mode, "sampling.guidance_scale=4.5")
    assert decode_media(t["image"][0].as_py()).shape == (7, 32, 32, 3)
    assert t["final_latent"].type.shape == [12, 2, 4, 4]
    if mode == "full":
        rep = CliRunner().invoke(app, ["replay", f"mochi-{mode}", "--iteration", "1", "--workdir", str(tmp_path)])
        assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output


def test_the_presets():
    from pixrl.config.loader import load_config

    cfg = load_config("mochi_video", ["model.path=/x"])
    m = cfg.model
    assert (m.family, m.size(), m.frames, m.max_sequence_length) == ("mochi", (480, 848), 31, 256)
    assert cfg.sampling.guidance_scale == 4.5 and cfg.algorithm.lora.enabled
