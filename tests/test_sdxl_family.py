"""The sdxl family (StableDiffusionXLPipeline) on a tiny random checkpoint written by `pixrl tiny
sdxl`: both towers' encodings and the zeroed negative prompt as the pipeline makes them, ODE
parity with the pipeline on its DDIMScheduler with and without CFG (the added time ids and pooled
embedding reach the UNet), the on-policy ratio with DDIM-η, and two RL iterations with LoRA
through the unchanged flow. The variance-preserving machinery is sd15's (test_sd15_family)."""

import json

import pytest
import torch

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.models.base import ModelLoadError
from pixrl.models.registry import get_family
from pixrl.models.sdxl import SDXLFamily

PROMPTS = ["a red circle", "two blue squares in the sky"]


@pytest.fixture(scope="module")
def family(tiny_sdxl):
    return SDXLFamily.load(tiny_sdxl[0], resolution=tiny_sdxl[1]["model.resolution"])


def test_encodings_are_the_pipelines_and_the_negative_is_zero(family):
    assert get_family("sdxl") is SDXLFamily and family.latent_shape() == (4, 8, 8)
    cond = family.encode_prompts(PROMPTS)
    pos, neg, pooled, neg_pooled = family.pipe.encode_prompt(PROMPTS, device=family.device, num_images_per_prompt=1,
                                                             do_classifier_free_guidance=True)
    assert torch.equal(cond.prompt_embeds, pos) and torch.equal(cond.pooled, pooled)
    assert cond.prompt_embeds.shape == (2, 77, 64) and cond.pooled.shape == (2, 32)
    empty = family.encode_prompts([""])
    assert torch.equal(empty.prompt_embeds, neg[:1]) and torch.equal(empty.pooled, neg_pooled[:1])
    assert not empty.prompt_embeds.any()  # force_zeros_for_empty_prompt


def _ddim_pipeline(family, cfg, negative):
    from diffusers import DDIMScheduler

    pipe = family.pipe
    shipped, pipe.scheduler = pipe.scheduler, DDIMScheduler.from_config(pipe.scheduler.config)
    try:
        return pipe(PROMPTS, negative_prompt=None if negative is None else [negative] * 2, height=family.height,
                    width=family.width, num_inference_steps=6, guidance_scale=cfg, eta=0.0, generator=gens([3, 4]),
                    output_type="latent").images
    finally:
        pipe.scheduler = shipped


def test_non_square_ode_equals_the_pipeline(tiny_sdxl):
    """The time ids carry (height, width) as the pipeline sets them."""
    fam = wide(SDXLFamily, tiny_sdxl[0], 16, 32)
    ref = _ddim_pipeline(fam, 5.0, None)
    traj = sample(fam, fam.encode_prompts(PROMPTS), fam.encode_negative("").expand(2), gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=5.0, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 8, 16)
    assert (traj.final - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (5.0, None), (5.0, "blurry, low quality")])
def test_ode_sampling_equals_the_pipeline_with_ddim(family, cfg, negative):
    """Relative to the latents' scale (~20 for a random ε-model), as for sd15. The pipeline
    encodes its negative prompt; without one (pixrl's empty negative prompt) it is zeros."""
    ref = _ddim_pipeline(family, cfg, negative)
    cond = family.encode_prompts(PROMPTS)
    neg = family.encode_negative(negative or "").expand(2) if cfg > 1 else None
    traj = sample(family, cond, neg, gens([3, 4]), SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert (traj.final - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
    family.height = 32  # the time ids carry the image size: another size conditions differently
    try:
        x = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(0))
        other = family.velocity(x, torch.tensor([501.0]), cond.select([0]))
    finally:
        family.height = 16
    assert not torch.allclose(other, family.velocity(x, torch.tensor([501.0]), cond.select([0])))


def test_replayed_ddim_log_probs_equal_stored_with_cfg(family):
    recipe = SamplerRecipe(steps=4, noise_level=1.0, sde_type="ddim", guidance_scale=5.0, train_steps=(0, 1, 2, 3))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_layout_errors_name_the_family(family, tiny_sd15):
    with pytest.raises(ModelLoadError, match="StableDiffusionPipeline, not a StableDiffusionXLPipeline"):
        SDXLFamily.load(tiny_sd15[0])


def test_two_rl_iterations_with_lora(tiny_sdxl, tmp_path, prefect_harness):
    out, t = two_iterations(tiny_sdxl, tmp_path, "sdxl", "lora", "sampling.guidance_scale=5.0")
    assert json.loads(t["recipe"][0].as_py())["guidance_scale"] == 5.0
