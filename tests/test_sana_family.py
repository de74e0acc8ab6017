"""The SANA family on a tiny random checkpoint written by `pixrl tiny sana` in the diffusers
layout: prompt encoding with the pipeline's instruction prefix, the σ grid of the shipped
DPMSolver flow scheduler, ODE parity with diffusers' SanaPipeline with and without CFG (on an
Euler scheduler, the one solver both can run), decode parity (DC-AE), the on-policy ratio, LoRA
targets and two RL iterations through the unchanged flow."""

import json

import numpy as np
import pytest
import torch

from family_checks import assert_replay_is_on_policy, euler, gens, wide
from conftest import two_iterations
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.models.base import ModelLoadError, uses_negative_prompt
from pixrl.models.registry import get_family
from pixrl.models.sana import SanaFamily

PROMPTS = ["a red circle", "two blue squares in the sky"]  # different lengths: a padding mask


@pytest.fixture(scope="module")
def family(tiny_sana):
    path, overrides = tiny_sana
    return SanaFamily.load(path, max_sequence_length=overrides["model.max_sequence_length"],
                           resolution=overrides["model.resolution"])


def _pipeline(family, cond, negative: str | None, cfg: float, seeds, output_type: str):
    """The pipeline given our prompt encodings, encoding its negative prompt itself."""
    kw = {"prompt_embeds": cond.prompt_embeds, "prompt_attention_mask": cond.mask}
    if negative is not None:
        kw.update(negative_prompt=negative)
    return family.pipe(num_inference_steps=6, guidance_scale=cfg, generator=gens(seeds), output_type=output_type,
                       height=family.height, width=family.width, use_resolution_binning=False,
                       max_sequence_length=family.max_sequence_length, **kw).images


def test_registered_and_guided_by_a_negative_prompt(family):
    assert get_family("sana") is SanaFamily
    assert uses_negative_prompt(SanaFamily, 4.5) and not uses_negative_prompt(SanaFamily, 1.0)
    assert family.latent_shape() == (4, 16, 16) and family.describe()["shift"] == 3.0


def test_encoding_is_the_pipelines_with_its_instruction_prefix(family):
    """The pipeline's `__call__` prepends its default instruction; BOS + the last L−1 tokens are kept."""
    cond = family.encode_prompts(PROMPTS)
    instruction = family._instruction()
    assert instruction and "User Prompt: " in instruction[-1]
    embeds, mask, _, _ = family.pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, device=family.device,
                                                   max_sequence_length=family.max_sequence_length,
                                                   complex_human_instruction=instruction)
    assert torch.equal(cond.prompt_embeds, embeds) and torch.equal(cond.mask, mask)
    assert cond.prompt_embeds.shape[:2] == (2, family.max_sequence_length)
    bare, _, _, _ = family.pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, device=family.device,
                                              max_sequence_length=family.max_sequence_length)
    assert not torch.equal(bare, embeds)  # the prefix reaches the encoding
    assert cond.mask[0].sum() < cond.mask[1].sum()


def test_schedule_is_the_shipped_dpm_solver_flow_grid(family):
    from copy import deepcopy

    sigmas, timesteps = family.schedule(6)
    ref = deepcopy(family.pipe.scheduler)
    ref.set_timesteps(6)
    assert type(ref).__name__ == "DPMSolverMultistepScheduler" and ref.config.use_flow_sigmas
    assert torch.equal(sigmas, ref.sigmas.float()) and torch.equal(timesteps, ref.timesteps.float())
    assert sigmas[-1] == 0 and bool((sigmas[:-1] > sigmas[1:]).all())
    assert torch.equal(timesteps, timesteps.round())  # DPMSolver feeds integer timesteps, as the pipeline does


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (4.5, ""), (4.5, "blurry, low quality")])
def test_ode_sampling_equals_sana_pipeline(family, cfg, negative):
    """With CFG the pipeline encodes its negative prompt (without the instruction prefix)."""
    seeds = [11, 12]
    cond = family.encode_prompts(PROMPTS)
    neg = family.encode_negative(negative).expand(2) if cfg > 1 else None
    with euler(family):
        ref = _pipeline(family, cond, negative, cfg, seeds, "latent")
        traj = sample(family, cond, neg, gens(seeds), SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 16, 16)
    assert (traj.final - ref).abs().max().item() <= 1e-5
    if cfg > 1:
        with euler(family):
            plain = sample(family, cond, None, gens(seeds), SamplerRecipe(6, 0.0, train_steps=()))
        assert (plain.final - traj.final).abs().max().item() > 1e-4


def test_non_square_ode_equals_sana_pipeline(tiny_sana):
    fam = wide(SanaFamily, tiny_sana[0], 32, 64, max_sequence_length=tiny_sana[1]["model.max_sequence_length"])
    cond, neg = fam.encode_prompts(PROMPTS), fam.encode_negative("").expand(2)
    with euler(fam):
        ref = _pipeline(fam, cond, "", 4.5, [11, 12], "latent")
        traj = sample(fam, cond, neg, gens([11, 12]), SamplerRecipe(6, 0.0, guidance_scale=4.5, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 16, 32)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_decode_equals_the_pipeline_images(family):
    cond, neg = family.encode_prompts(PROMPTS), family.encode_negative("").expand(2)
    with euler(family):
        ref = _pipeline(family, cond, "", 4.5, [3, 4], "np")
        traj = sample(family, cond, neg, gens([3, 4]), SamplerRecipe(6, 0.0, guidance_scale=4.5, train_steps=()))
    imgs = family.decode(traj.final)
    assert imgs.shape == (2, 32, 32, 3) and imgs.dtype == np.uint8
    assert np.abs(imgs.astype(int) - (ref * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, sde_type, window):
    """SDE at every step, CPS, and an SDE window (ODE outside steps 1–2): ratio exactly 1."""
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=4.5, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_lora_targets_and_layout_errors(family, tiny_flux):
    names = [n for n, _ in family.transformer.named_modules()]
    for target in SanaFamily.lora_targets:
        assert any(n.endswith(target) for n in names), f"LoRA target {target} matches no module"
    with pytest.raises(ModelLoadError, match="FluxPipeline, not a SanaPipeline"):
        SanaFamily.load(tiny_flux[0])
    with pytest.raises(ModelLoadError, match="resolution=33.*multiple of 2"):
        SanaFamily.load(family.path, max_sequence_length=64, resolution=33)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_rl_iterations_through_the_unchanged_flow(tiny_sana, tmp_path, prefect_harness, mode):
    """LoRA on the family's targets (adapter weights only) and full fine-tuning: both train."""
    negative = ["sampling.negative_prompt=blurry, low quality"] if mode == "full" else []
    out, t = two_iterations(tiny_sana, tmp_path, "sana", mode, "sampling.guidance_scale=4.5", *negative)
    recipe = json.loads(t["recipe"][0].as_py())
    assert recipe["guidance_scale"] == 4.5 and recipe["negative_prompt"] == ("blurry, low quality" if negative else "")
    if negative:
        _replay_and_generate_with_the_negative_prompt(tmp_path)


def _replay_and_generate_with_the_negative_prompt(tmp_path):
    """The recorded negative prompt replays the update exactly; `pixrl generate` samples with the
    run's, or with --negative-prompt's, and records it."""
    from typer.testing import CliRunner

    from pixrl.cli import app

    rep = CliRunner().invoke(app, ["replay", "sana", "--iteration", "1", "--workdir", str(tmp_path)])
    assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output
    base = ["generate", "--run", "sana", "--workdir", str(tmp_path), "--prompt", PROMPTS[0], "--steps", "2"]
    for folder, extra in (("own", []), ("other", ["--negative-prompt", "a red circle"])):
        res = CliRunner().invoke(app, [*base, "--out", str(tmp_path / folder), *extra])
        assert res.exit_code == 0, res.output
    sidecar = lambda d: json.loads((tmp_path / d / "0000_00.json").read_text())  # noqa: E731
    assert sidecar("own")["negative_prompt"] == "blurry, low quality" and sidecar("other")["negative_prompt"] == "a red circle"
    assert (tmp_path / "own" / "0000_00.png").read_bytes() != (tmp_path / "other" / "0000_00.png").read_bytes()
