"""Z-Image on a tiny random checkpoint written by `pixrl tiny z_image` in the diffusers layout:
prompt encoding (Qwen3 under the chat template, each caption its own length), the pipeline's σ
grid, ODE sampling equal to ZImagePipeline's with and without CFG (its w = pixrl's s − 1),
decoded images equal, replayed log-probs equal to the stored ones, the LoRA targets, and two RL
iterations through the unchanged flow with LoRA and full fine-tuning."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.z_image import ZImageFamily

PROMPTS = ["a red circle", "two blue squares in the sky"]


@pytest.fixture(scope="module")
def tiny_z(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-z-image"
    return out, ZImageFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_z):
    return ZImageFamily.load(tiny_z[0], max_sequence_length=64, resolution=32)


def _pipeline(family, cfg: float, seeds, output_type: str, negative: str | None = None, truncation: float = 1.0):
    return family.pipe(prompt=list(PROMPTS), negative_prompt=None if negative is None else [negative] * len(PROMPTS),
                       guidance_scale=cfg - 1.0, num_inference_steps=6, generator=gens(seeds), cfg_truncation=truncation,
                       output_type=output_type, height=family.height, width=family.width,
                       max_sequence_length=64).images


def test_registered_and_found_from_its_layout(tiny_z, family):
    assert get_family("z_image") is ZImageFamily and family_of_directory(tiny_z[0]) == "z_image"
    assert family.latent_shape() == (4, 16, 16)
    names = [n for n, _ in family.transformer.named_modules()]
    assert all(any(n.endswith(t) for n in names) for t in ZImageFamily.lora_targets)


def test_encoding_is_the_pipelines_with_each_captions_own_length(family):
    cond = family.encode_prompts(PROMPTS)
    ref, _ = family.pipe.encode_prompt(list(PROMPTS), device="cpu", do_classifier_free_guidance=False,
                                       max_sequence_length=64)
    assert [len(r) for r in ref] == cond.lengths.tolist() and cond.lengths[0] != cond.lengths[1]
    assert all(torch.equal(a, b) for a, b in zip(cond.captions(), ref))
    assert cond.prompt_embeds[0, int(cond.lengths[0]):].abs().sum() == 0
    sub = cond.select([1]).expand(3)
    assert sub.prompt_embeds.shape[0] == 3 and torch.equal(sub.captions()[2], ref[1])


def test_schedule_is_the_pipelines(family):
    from copy import deepcopy

    from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas, retrieve_timesteps

    sigmas, timesteps = family.schedule(6)
    sched = deepcopy(family.pipe.scheduler)
    ref, _ = retrieve_timesteps(sched, 6, "cpu", sigmas=get_default_z_image_sigmas(6), mu=family._mu())
    assert torch.equal(timesteps, ref.float()) and torch.equal(sigmas, sched.sigmas.float()) and sigmas[-1] == 0


@pytest.mark.parametrize("truncation", [0.2, 0.5])  # 1 − t/1000 on the 6-step grid: 0 … 0.625
def test_cfg_truncation_equals_the_pipelines_by_its_time_rule(family, truncation):
    """ZImagePipeline drops CFG once 1 − t/1000 exceeds `cfg_truncation` (time, not the step count)."""
    ref = _pipeline(family, 4.0, [3, 4], "latent", truncation=truncation)
    neg = family.encode_negative("").expand(2)
    recipe = SamplerRecipe(6, 0.0, guidance_scale=4.0, train_steps=(), cfg_truncation=truncation)
    traj = sample(family, family.encode_prompts(PROMPTS), neg, gens([3, 4]), recipe)
    assert (traj.final - ref).abs().max().item() <= 1e-5
    full = sample(family, family.encode_prompts(PROMPTS), neg, gens([3, 4]), replace(recipe, cfg_truncation=1.0))
    assert (traj.final - full.final).abs().max().item() > 1e-4


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (4.0, None), (4.0, "blurry, low quality")])
def test_ode_sampling_equals_z_image_pipeline(family, cfg, negative):
    ref = _pipeline(family, cfg, [3, 4], "latent", negative)
    neg = family.encode_negative(negative or "").expand(2) if cfg > 1 else None
    traj = sample(family, family.encode_prompts(PROMPTS), neg, gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 16, 16)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_non_square_ode_equals_z_image_pipeline(tiny_z):
    fam = wide(ZImageFamily, tiny_z[0], 32, 64, max_sequence_length=64)
    ref = _pipeline(fam, 4.0, [3, 4], "latent")
    traj = sample(fam, fam.encode_prompts(PROMPTS), fam.encode_negative("").expand(2), gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=4.0, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 16, 32)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_decoded_images_equal_the_pipeline(family):
    ref = _pipeline(family, 4.0, [5, 6], "np")
    traj = sample(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), gens([5, 6]),
                  SamplerRecipe(6, 0.0, guidance_scale=4.0, train_steps=()))
    images = family.decode(traj.final)
    assert images.shape == (2, 32, 32, 3) and images.dtype == np.uint8
    assert np.abs(images.astype(int) - (np.asarray(ref) * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=4.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_rl_iterations_through_the_unchanged_flow(tiny_z, tmp_path, prefect_harness, mode):
    out, t = two_iterations(tiny_z, tmp_path, f"z_{mode}", mode, "sampling.guidance_scale=4.0")
    assert t["final_latent"].type.shape == [4, 16, 16]
