"""Cosmos-Predict2 text-to-image on a tiny random checkpoint written by `pixrl tiny cosmos2` in
the diffusers layout: T5 encodings, the EDM Karras grid as flow noise levels (its last point
repeated), ODE sampling equal to Cosmos2TextToImagePipeline's with and without CFG (its w =
pixrl's s − 1) — the pipeline steps EDM coordinates, pixrl the flow it is — decoded images
equal, replayed log-probs equal to the stored ones, the zero-length last step refused where it
would be stored, a wrong directory refused, and two RL iterations through the unchanged flow
with LoRA and full fine-tuning."""

import json
import shutil
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from conftest import two_iterations
from family_checks import PassingGuardrail, assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.config.loader import load_config
from pixrl.models.base import ModelLoadError
from pixrl.models.cosmos2 import Cosmos2Family
from pixrl.models.registry import family_of_directory, get_family

PROMPTS = ["a red circle", "two blue squares in the sky"]


@pytest.fixture(scope="module")
def tiny_cosmos(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-cosmos2"
    return out, Cosmos2Family.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_cosmos):
    return Cosmos2Family.load(tiny_cosmos[0], max_sequence_length=64, resolution=32)


@contextmanager
def _guarded(family):
    family.pipe.safety_checker = PassingGuardrail()
    try:
        yield family.pipe
    finally:
        family.pipe.safety_checker = None


def _pipeline(family, cfg: float, seeds, output_type: str = "latent", negative: str = "", steps: int = 6):
    with _guarded(family) as pipe:
        out = pipe(prompt=list(PROMPTS), negative_prompt=[negative] * len(PROMPTS), guidance_scale=cfg - 1.0,
                   num_inference_steps=steps, generator=gens(seeds), output_type=output_type, height=family.height,
                   width=family.width, max_sequence_length=64).images
    return out[:, :, None] if output_type == "latent" else out  # the pipeline drops the one frame


def _ode(family, cfg: float, seeds, negative: str = "", steps: int = 6):
    neg = family.encode_negative(negative).expand(2) if cfg > 1 else None
    return sample(family, family.encode_prompts(PROMPTS), neg, gens(seeds),
                  SamplerRecipe(steps, 0.0, guidance_scale=cfg, train_steps=()))


def test_registered_and_found_from_its_layout(tiny_cosmos, family):
    assert get_family("cosmos2") is Cosmos2Family and family_of_directory(tiny_cosmos[0]) == "cosmos2"
    assert family.latent_shape() == (4, 1, 8, 8) and family.pipe.safety_checker is None
    names = [n for n, _ in family.transformer.named_modules()]
    assert all(any(n.endswith(t) for n in names) for t in Cosmos2Family.lora_targets)


def test_encoding_is_the_pipelines(family):
    cond = family.encode_prompts(PROMPTS)
    ref, _ = family.pipe.encode_prompt(list(PROMPTS), do_classifier_free_guidance=False, device="cpu",
                                       max_sequence_length=64)
    assert torch.equal(cond.prompt_embeds, ref) and cond.prompt_embeds.shape == (2, 64, 32)
    assert cond.prompt_embeds[0, 10:].abs().sum() == 0  # zero past the prompt's tokens


def test_schedule_is_the_karras_edm_grid_as_flow_noise_levels(family):
    from copy import deepcopy

    sigmas, timesteps = family.schedule(6)
    sched = deepcopy(family.pipe.scheduler)
    sched.set_timesteps(sigmas=torch.linspace(0, 1, 6, dtype=torch.float64))
    edm = sched.sigmas.clone()
    edm[-1] = edm[-2]  # the pipeline's final_sigmas_type="sigma_min"
    assert abs(float(edm[0]) - 80.0) < 1e-4 and abs(float(edm[-1]) - 0.002) < 1e-7
    assert torch.equal(sigmas, edm / (edm + 1)) and torch.equal(timesteps, sigmas[:-1])
    assert sigmas[-1] == sigmas[-2] > 0  # the zero-length last step


@pytest.mark.parametrize("cfg,negative", [(1.0, ""), (8.0, ""), (4.0, "blurry, low quality")])
def test_ode_sampling_equals_the_pipeline(family, cfg, negative):
    """The pipeline's EDM Euler step on x = x0 + σε is pixrl's flow Euler step exactly; its
    float32 rounding of x ≈ 80ε at the start leaves a few 1e-6 on latents of about 3."""
    ref = _pipeline(family, cfg, [3, 4], negative=negative)
    traj = _ode(family, cfg, [3, 4], negative)
    assert traj.final.shape == ref.shape == (2, 4, 1, 8, 8)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_the_pipelines_35_steps_and_a_non_square_image(tiny_cosmos):
    fam = wide(Cosmos2Family, tiny_cosmos[0], 32, 48, max_sequence_length=64)
    ref = _pipeline(fam, 8.0, [3, 4], steps=35)
    traj = _ode(fam, 8.0, [3, 4], steps=35)
    assert traj.final.shape == ref.shape == (2, 4, 1, 8, 12)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_decoded_images_equal_the_pipelines(family):
    ref = _pipeline(family, 8.0, [5, 6], output_type="np")
    images = family.decode(_ode(family, 8.0, [5, 6]).final)
    assert images.shape == (2, 32, 32, 3) and images.dtype == np.uint8
    assert np.abs(images.astype(int) - (np.asarray(ref) * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", (0, 1, 2, 3)), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, sde_type, window):
    recipe = SamplerRecipe(steps=6, noise_level=0.7, sde_type=sde_type, guidance_scale=8.0, sde_steps=window,
                           train_steps=window or (0, 1, 2, 3, 4))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_the_sde_leaves_the_zero_length_last_step_unmoved(family):
    """At the last step (σ_min → σ_min) Flow-GRPO's SDE, DanceGRPO's and DDPO's DDIM-η have std 0
    and mean x — the step moves nothing, as the pipeline's — while CPS would add noise there (so
    preflight refuses it); a rollout with every step stochastic ends finite."""
    from pixrl.algorithms.flow_sde import flow_step

    sigmas, _ = family.schedule(6)
    s = float(sigmas[-2])
    x, v, eps = (torch.randn(2, 4, 1, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for kind in ("sde", "dance", "ddim"):
        out = flow_step(v, x, s, s, float(sigmas[1]), 0.7, kind, noise=eps)
        assert torch.equal(out.std, torch.zeros(2)) and torch.allclose(out.prev_sample, x, atol=1e-6), kind
    cps = flow_step(v, x, s, s, float(sigmas[1]), 0.7, "cps", noise=eps)
    assert (cps.std > 0).all() and not torch.allclose(cps.prev_sample, x, atol=1e-4)
    recipe = SamplerRecipe(steps=6, noise_level=0.7, sde_type="sde", guidance_scale=8.0, train_steps=(4,))
    traj = sample(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), gens([1, 2]), recipe)
    assert torch.isfinite(traj.final).all() and torch.isfinite(traj.log_probs).all()


@pytest.mark.parametrize("compress", [1.0, 0.5])
def test_the_dpm_solver_tails_take_the_zero_length_step_as_the_identity(family, compress):
    """DiffusionNFT's dpm2 rollouts and MixGRPO-Flash's compressed tail end at the grid's σ_min:
    the last step moves nothing (before, h = 0 divided by zero), and the tail stays on the grid."""
    from pixrl.algorithms.ode_solvers import compressed_tail, dpm_step

    x, v, x0 = torch.randn(2, 4, 1, 8, 8), torch.randn(2, 4, 1, 8, 8), torch.randn(2, 4, 1, 8, 8)
    same, _ = dpm_step(x, v, 0.002, 0.002, prev_x0=x0, prev_sigma=0.08)
    assert torch.equal(same, x)
    sigmas, _ = family.schedule(6)
    tail = compressed_tail(sigmas, 1, 0.5, 1.0)
    assert tail[0] == sigmas[2] and tail[-1] == sigmas[-1] > 0 and bool((tail[:-1] > tail[1:]).all())
    recipe = SamplerRecipe(6, 0.7, "sde", 8.0, (0, 1), (0, 1), ode_solver="dpm2", tail_compress=compress)
    traj = sample(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), gens([1, 2]), recipe)
    assert torch.isfinite(traj.final).all()


@pytest.mark.parametrize("overrides,match", [
    (["sampling.timestep_fraction=1.0", "sampling.window_size=null", "sampling.window_range=null"], "stores step 5"),
    (["sampling.window_size=2", "sampling.window_range=[3,6]"], "stores step 5"),
    (["sampling.sde_type=cps", "sampling.window_size=null", "sampling.window_range=null"], "adds CPS noise at step 5"),
])
def test_the_zero_length_last_step_is_refused_where_it_would_be_stored_or_noised(tiny_cosmos, overrides, match):
    cfg = load_config(None, [f"{k}={v}" for k, v in tiny_cosmos[1].items()] + ["sampling.steps=6", *overrides])
    with pytest.raises(ModelLoadError, match=match):
        Cosmos2Family.check_options(tiny_cosmos[0], {}, cfg.sampling)
    fine = load_config(None, [f"{k}={v}" for k, v in tiny_cosmos[1].items()] + ["sampling.steps=6"])
    Cosmos2Family.check_options(tiny_cosmos[0], {}, fine.sampling)


def test_a_listed_guardrail_is_not_required_and_a_wrong_or_partial_directory_is_refused(tiny_cosmos, tmp_path,
                                                                                          tiny_sd15):
    listed = tmp_path / "with-guardrail"
    shutil.copytree(tiny_cosmos[0], listed)
    index = json.loads((listed / "model_index.json").read_text())
    (listed / "model_index.json").write_text(json.dumps({**index, "safety_checker": ["cosmos_guardrail",
                                                                                     "CosmosSafetyChecker"]}))
    assert Cosmos2Family.load(listed, max_sequence_length=64, resolution=32).pipe.safety_checker is None
    with pytest.raises(ModelLoadError, match="holds a StableDiffusionPipeline, not a Cosmos2TextToImagePipeline"):
        Cosmos2Family.load(tiny_sd15[0])
    shutil.rmtree(listed / "vae")
    with pytest.raises(ModelLoadError, match=r"lacks vae/ \(AutoencoderKLWan\)"):
        Cosmos2Family.load(listed)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_rl_iterations_through_the_unchanged_flow(tiny_cosmos, tmp_path, prefect_harness, mode):
    out, t = two_iterations(tiny_cosmos, tmp_path, f"cosmos_{mode}", mode, "sampling.guidance_scale=8.0")
    assert t["final_latent"].type.shape == [4, 1, 8, 8]


def test_the_presets_keep_the_zero_length_step_out_and_negate_as_the_pipeline(tiny_cosmos):
    from diffusers.pipelines.cosmos.pipeline_cosmos2_text2image import DEFAULT_NEGATIVE_PROMPT

    cfg = load_config("cosmos2_pickscore", ["model.path=/x"])
    assert (cfg.model.family, cfg.model.resolution, cfg.sampling.guidance_scale) == ("cosmos2", 512, 8.0)
    assert cfg.sampling.negative_prompt == DEFAULT_NEGATIVE_PROMPT and cfg.algorithm.lora.rank == 64
    Cosmos2Family.check_options(tiny_cosmos[0], {}, cfg.sampling)
    plain = load_config("cosmos2_pickscore", ["model.path=/x", "sampling.window_size=null",
                                              "sampling.window_range=null"])
    Cosmos2Family.check_options(tiny_cosmos[0], {}, plain.sampling)  # 9 of 10 stored: the last left out
    assert load_config(None, ["model=cosmos2_14b_t2i", "model.path=/x"]).model.gradient_checkpointing
