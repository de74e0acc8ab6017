"""The FLUX.2 family on a tiny random checkpoint written by `pixrl tiny flux2` in the diffusers
layout: prompt encoding (Mistral-3 layers 10/20/30 under the pipeline's system message), the
empirical-μ schedule, ODE parity with diffusers' Flux2Pipeline (embedded guidance, patchified
latents, 4-D ids), decode parity (batch-norm statistics, unpatchify), the on-policy ratio, LoRA
targets and two RL iterations through the unchanged flow."""

import json

import numpy as np
import pytest
import torch

from family_checks import assert_replay_is_on_policy, gens, wide
from conftest import two_iterations
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.models.base import ModelLoadError, uses_negative_prompt
from pixrl.models.flux2 import Flux2Family
from pixrl.models.registry import get_family

PROMPTS = ["a red circle", "two blue squares in the sky"]


@pytest.fixture(scope="module")
def family(tiny_flux2):
    path, overrides = tiny_flux2
    return Flux2Family.load(path, max_sequence_length=overrides["model.max_sequence_length"],
                            resolution=overrides["model.resolution"])


def _pipeline(family, guidance: float, seeds, output_type: str):
    return family.pipe(prompt=PROMPTS, num_inference_steps=6, guidance_scale=guidance, generator=gens(seeds),
                       output_type=output_type, height=family.height, width=family.width,
                       max_sequence_length=family.max_sequence_length).images


def test_registered_with_embedded_guidance(family):
    assert get_family("flux2") is Flux2Family
    assert not uses_negative_prompt(Flux2Family, 4.0)
    assert family.latent_shape() == (16, 8, 8) and family.describe()["image_seq_len"] == 64


def test_encoding_is_the_pipelines_and_keeps_the_prompt(family):
    cond = family.encode_prompts(PROMPTS)
    embeds, ids = family.pipe.encode_prompt(prompt=PROMPTS, device=family.device,
                                            max_sequence_length=family.max_sequence_length)
    assert torch.equal(cond.prompt_embeds, embeds) and torch.equal(cond.text_ids, ids)
    hidden = family.pipe.text_encoder.config.text_config.hidden_size
    assert cond.prompt_embeds.shape == (2, family.max_sequence_length, 3 * hidden)
    ids = family.pipe.tokenizer.apply_chat_template(
        [[{"role": "system", "content": [{"type": "text", "text": family.pipe.system_message}]},
          {"role": "user", "content": [{"type": "text", "text": PROMPTS[1]}]}]], tokenize=True, return_dict=True)
    assert len(ids["input_ids"][0]) < family.max_sequence_length  # nothing of the prompt is truncated away
    assert not torch.equal(cond.prompt_embeds[0], cond.prompt_embeds[1])


def test_schedule_uses_the_empirical_mu(family):
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    sigmas, timesteps = family.schedule(4)
    sched = family.pipe.scheduler
    sched.set_timesteps(sigmas=np.linspace(1.0, 0.25, 4), mu=compute_empirical_mu(64, 4))
    assert torch.equal(sigmas, sched.sigmas.float()) and torch.equal(timesteps, sched.timesteps.float())
    assert compute_empirical_mu(64, 4) != compute_empirical_mu(64, 8)  # μ depends on the steps, and so
    sched.set_timesteps(sigmas=np.linspace(1.0, 0.125, 8), mu=compute_empirical_mu(64, 8))  # does the grid
    assert torch.equal(family.schedule(8)[0], sched.sigmas.float())


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_ode_sampling_equals_flux2_pipeline(family, guidance):
    seeds = [11, 12]
    ref = _pipeline(family, guidance, seeds, "latent")  # packed [B, H·W, C]
    traj = sample(family, family.encode_prompts(PROMPTS), None, gens(seeds),
                  SamplerRecipe(6, 0.0, guidance_scale=guidance, train_steps=()))
    assert traj.final.shape == (2, 16, 8, 8)
    assert (family.pipe._pack_latents(traj.final) - ref).abs().max().item() <= 1e-5
    if guidance > 1:  # the embedded guidance reaches the model
        plain = sample(family, family.encode_prompts(PROMPTS), None, gens(seeds), SamplerRecipe(6, 0.0, train_steps=()))
        assert (plain.final - traj.final).abs().max().item() > 1e-4


def test_non_square_ode_equals_flux2_pipeline(tiny_flux2):
    fam = wide(Flux2Family, tiny_flux2[0], 32, 64, max_sequence_length=tiny_flux2[1]["model.max_sequence_length"])
    ref = _pipeline(fam, 4.0, [11, 12], "latent")
    traj = sample(fam, fam.encode_prompts(PROMPTS), None, gens([11, 12]),
                  SamplerRecipe(6, 0.0, guidance_scale=4.0, train_steps=()))
    assert traj.final.shape == (2, 16, 8, 16)
    assert (fam.pipe._pack_latents(traj.final) - ref).abs().max().item() <= 1e-5


def test_decode_equals_the_pipeline_images(family):
    ref = _pipeline(family, 4.0, [3, 4], "np")
    traj = sample(family, family.encode_prompts(PROMPTS), None, gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=4.0, train_steps=()))
    imgs = family.decode(traj.final)
    assert imgs.shape == (2, 32, 32, 3) and imgs.dtype == np.uint8
    assert np.abs(imgs.astype(int) - (ref * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored(family, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.9, sde_type=sde_type, guidance_scale=4.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), None, recipe)


def test_lora_targets_name_linear_layers_only(family, tiny_qwen_image):
    """Each target matches modules, and every match is a Linear (peft cannot wrap the double
    blocks' `to_out` ModuleList, hence the single blocks' outputs by full name)."""
    modules = dict(family.transformer.named_modules())
    for target in family.lora_targets:
        hits = [m for n, m in modules.items() if n == target or n.endswith("." + target)]
        assert hits and all(isinstance(m, torch.nn.Linear) for m in hits), target
    with pytest.raises(ModelLoadError, match="QwenImagePipeline, not a Flux2Pipeline"):
        Flux2Family.load(tiny_qwen_image[0])


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_rl_iterations_through_the_unchanged_flow(tiny_flux2, tmp_path, prefect_harness, mode):
    """LoRA on the family's targets (adapter weights only) and full fine-tuning: both train."""
    out, t = two_iterations(tiny_flux2, tmp_path, "flux2", mode, "sampling.guidance_scale=4.0")
    assert json.loads(t["recipe"][0].as_py())["guidance_scale"] == 4.0
    if mode == "lora":  # the single blocks' output projections, targeted by full name, were adapted
        from safetensors.torch import load_file

        last = sorted((tmp_path / "checkpoints" / "flux2").glob("*/it_*"))[-1]
        assert any("single_transformer_blocks.1.attn.to_out" in k for k in load_file(str(last / "trainable.safetensors")))
