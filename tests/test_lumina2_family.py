"""The Lumina-Image 2.0 family on a tiny random checkpoint written by `pixrl tiny lumina2` in the
diffusers layout: captions (Gemma-2, system prompt, the negative bare), the σ grid, ODE parity
with Lumina2Pipeline without CFG and with it (with and without its renormalisation), decode
parity, the on-policy ratio, LoRA targets and two RL iterations through the unchanged flow."""

import json

import numpy as np
import pytest
import torch

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.models.base import ModelLoadError, uses_negative_prompt
from pixrl.models.lumina2 import Lumina2Family
from pixrl.models.registry import family_of_directory, get_family

PROMPTS = ["a red circle", "two blue squares in the sky"]


def _load(path, overrides, **options):
    return Lumina2Family.load(path, max_sequence_length=overrides["model.max_sequence_length"],
                              resolution=overrides["model.resolution"], **options)


@pytest.fixture(scope="module")
def family(tiny_lumina2):
    return _load(*tiny_lumina2)


def _pipeline(family, guidance, seeds, output_type="latent", normalise=True, truncation=1.0):
    return family.pipe(prompt=PROMPTS, num_inference_steps=6, guidance_scale=guidance, generator=gens(seeds),
                       output_type=output_type, height=family.height, width=family.width,
                       max_sequence_length=family.max_sequence_length, cfg_normalization=normalise,
                       cfg_trunc_ratio=truncation).images


def _ode(family, guidance, seeds, truncation=1.0):
    neg = family.encode_negative("").expand(2) if guidance > 1 else None
    return sample(family, family.encode_prompts(PROMPTS), neg, gens(seeds),
                  SamplerRecipe(6, 0.0, guidance_scale=guidance, train_steps=(), cfg_truncation=truncation))


def test_registered_with_cfg(family, tiny_lumina2):
    assert get_family("lumina2") is Lumina2Family and family_of_directory(tiny_lumina2[0]) == "lumina2"
    assert uses_negative_prompt(Lumina2Family, 4.0) and family.latent_shape() == (4, 8, 8)
    with pytest.raises(ModelLoadError, match="no such setting"):  # a sampling setting: sampling.cfg_truncation
        _load(*tiny_lumina2, cfg_trunc_ratio=0.25)


@pytest.mark.parametrize("negative", ["", "blurry, low quality"])
def test_captions_are_the_pipelines(family, negative):
    """Prompts under the system prompt; the negative prompt bare, as the pipeline encodes it."""
    cond, uncond = family.encode_prompts(PROMPTS), family.encode_negative(negative)
    pos, pos_mask, neg, neg_mask = family.pipe.encode_prompt(PROMPTS, True, negative_prompt=[negative] * 2,
                                                             device=family.device,
                                                             max_sequence_length=family.max_sequence_length)
    assert torch.equal(cond.prompt_embeds, pos) and torch.equal(cond.attention_mask, pos_mask)
    assert torch.equal(uncond.prompt_embeds[0], neg[0]) and torch.equal(uncond.attention_mask[0], neg_mask[0])
    assert not torch.equal(uncond.prompt_embeds, family.encode_prompts([negative]).prompt_embeds)
    assert int(cond.attention_mask[1].sum()) < family.max_sequence_length  # the prompt is not cut away


def test_schedule_is_the_pipelines(family):
    sigmas, timesteps = family.schedule(6)
    _pipeline(family, 1.0, [0, 1])  # sets the pipeline's scheduler for 6 steps
    assert torch.equal(sigmas, family.pipe.scheduler.sigmas.float())
    assert torch.equal(timesteps, family.pipe.scheduler.timesteps.float())


@pytest.mark.parametrize("guidance,normalise", [(1.0, True), (4.0, True), (4.0, False)])
def test_ode_sampling_equals_lumina2_pipeline(tiny_lumina2, guidance, normalise):
    fam = _load(*tiny_lumina2, cfg_normalization=normalise)
    traj = _ode(fam, guidance, [11, 12])
    ref = _pipeline(fam, guidance, [11, 12], normalise=normalise)  # the final latents, before the VAE's scale
    assert (traj.final - ref).abs().max().item() <= 1e-5
    if guidance > 1:
        assert (_ode(fam, 1.0, [11, 12]).final - traj.final).abs().max().item() > 1e-4


def test_non_square_ode_equals_lumina2_pipeline(tiny_lumina2):
    fam = wide(Lumina2Family, tiny_lumina2[0], 64, 32, max_sequence_length=tiny_lumina2[1]["model.max_sequence_length"])
    traj = _ode(fam, 4.0, [11, 12])
    ref = _pipeline(fam, 4.0, [11, 12])
    assert traj.final.shape == ref.shape and ref.shape[-2] == 2 * ref.shape[-1]
    assert (traj.final - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("truncation", [0.25, 0.5])
def test_cfg_truncation_equals_the_pipelines_cfg_trunc_ratio(family, truncation):
    """Lumina-Image 2.0's recommended sampling guides only the first quarter of the steps."""
    traj = _ode(family, 4.0, [5, 6], truncation)
    assert (traj.final - _pipeline(family, 4.0, [5, 6], truncation=truncation)).abs().max().item() <= 1e-5
    assert (traj.final - _ode(family, 4.0, [5, 6]).final).abs().max().item() > 1e-4
    recipe = SamplerRecipe(steps=4, noise_level=0.7, guidance_scale=4.0, train_steps=(0, 1, 2), cfg_truncation=0.5)
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_decode_equals_the_pipeline_images(family):
    imgs = family.decode(_ode(family, 4.0, [3, 4]).final)
    ref = _pipeline(family, 4.0, [3, 4], output_type="np")
    assert imgs.shape == (2, 64, 64, 3) and np.abs(imgs.astype(int) - (ref * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored(family, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=4.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_lora_targets_name_linear_layers_only(family):
    modules = dict(family.transformer.named_modules())
    for target in family.lora_targets:
        hits = [m for n, m in modules.items() if n == target or n.endswith("." + target)]
        assert hits and all(isinstance(m, torch.nn.Linear) for m in hits), target


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_rl_iterations_through_the_unchanged_flow(tiny_lumina2, tmp_path, prefect_harness, mode):
    """Full fine-tuning with Lumina-2's truncated CFG (its rows' recipe keeps it; the update replays it)."""
    truncation = 0.5 if mode == "full" else 1.0
    out, t = two_iterations(tiny_lumina2, tmp_path, "lumina2", mode, "sampling.guidance_scale=4.0",
                            f"sampling.cfg_truncation={truncation}")
    recipe = json.loads(t["recipe"][0].as_py())
    assert recipe["guidance_scale"] == 4.0 and recipe["cfg_truncation"] == truncation
    if mode == "full":  # the recorded recipe replays the update exactly
        from typer.testing import CliRunner

        from pixrl.cli import app

        rep = CliRunner().invoke(app, ["replay", "lumina2", "--iteration", "1", "--workdir", str(tmp_path)])
        assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output
