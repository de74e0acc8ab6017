"""The FLUX.2 [klein] family on a tiny random checkpoint written by `pixrl tiny flux2_klein` in the
diffusers layout: Qwen3 prompt encoding (layers 9/18/27 under the chat template), ODE parity with
diffusers' Flux2KleinPipeline without and with true CFG, a step-distilled checkpoint sampling
without guidance as the pipeline does, an edit's reference kept by the unconditional pass,
decode parity, the on-policy ratio, LoRA targets and two RL iterations through the unchanged flow."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.models.base import ModelLoadError, uses_negative_prompt
from pixrl.models.flux2_klein import Flux2KleinFamily
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.source_images import png_bytes

PROMPTS = ["a red circle", "two blue squares in the sky"]


def _load(path, overrides, resolution=None):
    return Flux2KleinFamily.load(path, max_sequence_length=overrides["model.max_sequence_length"],
                                 resolution=resolution or overrides["model.resolution"])


@pytest.fixture(scope="module")
def family(tiny_flux2_klein):
    return _load(*tiny_flux2_klein)


def _pipeline_latents(family, guidance: float, seeds, prompts=PROMPTS, image=None):
    """The pipeline's final latents ("latent" output: de-normalised and unpatchified)."""
    return family.pipe(prompt=prompts, image=image, num_inference_steps=6, guidance_scale=guidance,
                       generator=gens(seeds), output_type="latent", height=family.height,
                       width=family.width, max_sequence_length=family.max_sequence_length).images


def _as_pipeline_latents(family, final: torch.Tensor) -> torch.Tensor:
    vae = family.vae
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return family.pipe._unpatchify_latents(final * std + mean)


def _ode(family, cond, neg, seeds, guidance):
    return sample(family, cond, neg, gens(seeds), SamplerRecipe(6, 0.0, guidance_scale=guidance, train_steps=()))


def test_registered_with_true_cfg(family, tiny_flux2_klein):
    assert get_family("flux2_klein") is Flux2KleinFamily and family_of_directory(tiny_flux2_klein[0]) == "flux2_klein"
    assert uses_negative_prompt(Flux2KleinFamily, 4.0) and not uses_negative_prompt(Flux2KleinFamily, 1.0)
    assert family.latent_shape() == (16, 8, 8) and not family.distilled and family.describe()["guidance"] == "cfg"


def test_encoding_is_the_pipelines_qwen3_layers(family):
    cond = family.encode_prompts(PROMPTS)
    embeds, ids = family.pipe.encode_prompt(prompt=PROMPTS, device=family.device,
                                            max_sequence_length=family.max_sequence_length)
    assert torch.equal(cond.prompt_embeds, embeds) and torch.equal(cond.text_ids, ids)
    assert cond.prompt_embeds.shape == (2, family.max_sequence_length, 3 * 16)
    text = family.pipe.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[1]}], tokenize=False,
                                                      add_generation_prompt=True, enable_thinking=False)
    assert len(family.pipe.tokenizer(text)["input_ids"]) < family.max_sequence_length  # nothing truncated
    assert not torch.equal(cond.prompt_embeds[0], cond.prompt_embeds[1])


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_ode_sampling_equals_flux2_klein_pipeline(family, guidance):
    seeds = [11, 12]
    neg = family.encode_negative("").expand(2) if guidance > 1 else None
    traj = _ode(family, family.encode_prompts(PROMPTS), neg, seeds, guidance)
    ref = _pipeline_latents(family, guidance, seeds)
    assert (_as_pipeline_latents(family, traj.final) - ref).abs().max().item() <= 1e-5
    if guidance > 1:  # true CFG reaches the model
        plain = _ode(family, family.encode_prompts(PROMPTS), None, seeds, 1.0)
        assert (plain.final - traj.final).abs().max().item() > 1e-4


def test_non_square_ode_equals_flux2_klein_pipeline(tiny_flux2_klein):
    fam = _load(*tiny_flux2_klein, resolution=(64, 32))
    traj = _ode(fam, fam.encode_prompts(PROMPTS), fam.encode_negative("").expand(2), [11, 12], 4.0)
    ref = _pipeline_latents(fam, 4.0, [11, 12])
    assert traj.final.shape[-2:] == (16, 8)
    assert (_as_pipeline_latents(fam, traj.final) - ref).abs().max().item() <= 1e-5


def test_a_step_distilled_checkpoint_samples_without_guidance_as_the_pipeline_does(tmp_path):
    overrides = Flux2KleinFamily.write_tiny(tmp_path / "distilled", distilled=True)
    fam = _load(tmp_path / "distilled", overrides)
    assert fam.distilled and "distilled" in fam.describe()["guidance"]
    neg = fam.encode_negative("").expand(2)
    guided = _ode(fam, fam.encode_prompts(PROMPTS), neg, [1, 2], 4.0)
    assert torch.equal(guided.final, _ode(fam, fam.encode_prompts(PROMPTS), None, [1, 2], 1.0).final)
    assert (_as_pipeline_latents(fam, guided.final) - _pipeline_latents(fam, 4.0, [1, 2])).abs().max().item() <= 1e-5


def test_an_edit_keeps_its_reference_in_the_unconditional_pass(tiny_flux2_klein):
    """At 64 px (the pipeline refuses references under 64 px a side), with CFG 4: ODE latents equal
    Flux2KleinPipeline's given one reference `image` per call."""
    fam = _load(*tiny_flux2_klein, resolution=64)
    rng = np.random.default_rng(3)
    sources = [png_bytes(rng.integers(0, 256, (64, 64, 3))) for _ in PROMPTS]
    traj = _ode(fam, fam.encode_prompts(PROMPTS, sources), fam.encode_negative("").expand(2), [5, 6], 4.0)
    for i, (prompt, src, seed) in enumerate(zip(PROMPTS, sources, [5, 6])):
        ref = _pipeline_latents(fam, 4.0, [seed], [prompt], [Image.open(io.BytesIO(src)).convert("RGB")])
        assert (_as_pipeline_latents(fam, traj.final[i:i + 1]) - ref).abs().max().item() <= 1e-5


def test_decode_equals_the_pipeline_images(family):
    neg = family.encode_negative("").expand(2)
    traj = _ode(family, family.encode_prompts(PROMPTS), neg, [3, 4], 4.0)
    ref = family.pipe(prompt=PROMPTS, num_inference_steps=6, guidance_scale=4.0, generator=gens([3, 4]),
                      output_type="np", height=32, width=32, max_sequence_length=family.max_sequence_length).images
    imgs = family.decode(traj.final)
    assert imgs.shape == (2, 32, 32, 3) and np.abs(imgs.astype(int) - (ref * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("dance", (0, 1)), ("cps", (1, 2))])
def test_replayed_log_probs_equal_stored(family, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=4.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_lora_targets_name_linear_layers_only(family, tiny_flux2):
    modules = dict(family.transformer.named_modules())
    for target in family.lora_targets:
        hits = [m for n, m in modules.items() if n == target or n.endswith("." + target)]
        assert hits and all(isinstance(m, torch.nn.Linear) for m in hits), target
    with pytest.raises(ModelLoadError, match="Flux2Pipeline, not a Flux2KleinPipeline"):
        Flux2KleinFamily.load(tiny_flux2[0])


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_rl_iterations_through_the_unchanged_flow(tiny_flux2_klein, tmp_path, prefect_harness, mode):
    out, t = two_iterations(tiny_flux2_klein, tmp_path, "flux2_klein", mode, "sampling.guidance_scale=4.0")
    assert json.loads(t["recipe"][0].as_py())["guidance_scale"] == 4.0
