"""The sd15 family (StableDiffusionPipeline: a UNet with ε- or v-prediction on a DDPM schedule)
on a tiny random checkpoint written by `pixrl tiny sd15`: the DDIM grid as flow noise levels,
ODE parity with diffusers' StableDiffusionPipeline on its DDIMScheduler (η = 0) with and
without CFG, decode parity, DDPO's DDIM-η step against DDIMScheduler.step and the written-out
log-prob, the on-policy ratio on every kernel, layout errors, and two RL iterations through the
unchanged flow (LoRA with Flow-GRPO, full fine-tuning with DDPO)."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.flow_sde import flow_step, vp_norm
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.models.base import ModelLoadError, uses_negative_prompt
from pixrl.models.registry import get_family
from pixrl.models.sd15 import SD15Family, sigma_of_alpha_bar

PROMPTS = ["a red circle", "two blue squares in the sky"]


@pytest.fixture(scope="module")
def family(tiny_sd15):
    return SD15Family.load(tiny_sd15[0], resolution=tiny_sd15[1]["model.resolution"])


@pytest.fixture(scope="module")
def v_family(tiny_sd15, tmp_path_factory):
    """The same checkpoint declared v-prediction (SD2.x's parameterisation)."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny-sd2v"
    shutil.copytree(tiny_sd15[0], out)
    cfg_file = out / "scheduler" / "scheduler_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "prediction_type": "v_prediction"}))
    return SD15Family.load(out)


def _ddim_pipeline(family):
    from diffusers import DDIMScheduler

    pipe = family.pipe
    return pipe, DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=False)


def _pipeline_latents(family, steps, cfg, seeds, negative=None):
    pipe, ddim = _ddim_pipeline(family)
    shipped, pipe.scheduler = pipe.scheduler, ddim
    try:
        return pipe(PROMPTS, negative_prompt=None if negative is None else [negative] * len(PROMPTS), height=family.height, width=family.width,
                    num_inference_steps=steps, guidance_scale=cfg, eta=0.0, generator=gens(seeds),
                    output_type="latent").images
    finally:
        pipe.scheduler = shipped


def test_registered_guided_and_variance_preserving(family):
    assert get_family("sd15") is SD15Family
    assert uses_negative_prompt(SD15Family, 5.0) and not uses_negative_prompt(SD15Family, 1.0)
    assert family.latent_shape() == (4, 8, 8) and family.prediction_type == "epsilon"
    assert type(family.pipe.scheduler).__name__ == "PNDMScheduler"  # as SD1.5 ships it; rollouts step DDIM
    assert family.describe()["final_alpha_bar"] == pytest.approx(1 - 0.00085)


def test_schedule_is_the_ddim_grid_as_flow_noise_levels(family):
    """Timesteps are DDIMScheduler's; σ_k = √(1−ᾱ)/(√ᾱ+√(1−ᾱ)) of ᾱ at each, then of ᾱ_0 (not 1:
    set_alpha_to_one is false for SD), and the continuous timestep map inverts it."""
    from copy import deepcopy

    sigmas, timesteps = family.schedule(10)
    ddim = deepcopy(family.ddim)
    ddim.set_timesteps(10)
    assert torch.equal(timesteps, ddim.timesteps.float())
    ab = ddim.alphas_cumprod.double()
    expect = [math.sqrt(1 - a) / (math.sqrt(a) + math.sqrt(1 - a)) for a in ab[ddim.timesteps].tolist() + [float(ab[0])]]
    assert np.allclose(sigmas.numpy(), expect, rtol=0, atol=1e-7)
    assert bool((sigmas[:-1] > sigmas[1:]).all()) and float(sigmas[-1]) == pytest.approx(0.02834, abs=1e-4)
    assert torch.allclose(family.timesteps_at(sigmas[:-1]), timesteps, atol=1e-3)
    assert torch.equal(family.alpha_bar_at(timesteps), ab[ddim.timesteps])
    mid = family.alpha_bar_at(torch.tensor([500.5]))
    assert float(ab[501]) < float(mid) < float(ab[500])
    assert float(sigma_of_alpha_bar(torch.tensor([1.0], dtype=torch.float64))) == 0.0


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (7.5, None), (7.5, "blurry, low quality")])
def test_ode_sampling_equals_the_pipeline_with_ddim(family, cfg, negative):
    """Euler on the flow grid is DDIM (η = 0). The random ε-model's latents reach ~20 (x̂0 divides
    by √ᾱ ≈ 0.1 at the first step), so float32 rounding is compared relative to that scale: under
    CFG 7.5 it reaches 2.3e-6 of it with one torch thread (the parallel suite's), less with two. The
    pipeline encodes its negative prompt (None: the empty prompt)."""
    ref = _pipeline_latents(family, 6, cfg, [3, 4], negative)
    cond = family.encode_prompts(PROMPTS)
    neg = family.encode_negative(negative or "").expand(2) if cfg > 1 else None
    traj = sample(family, cond, neg, gens([3, 4]), SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 8, 8)
    assert (traj.final - ref).abs().max().item() <= 3e-6 * ref.abs().max().item()


def test_non_square_ode_equals_the_pipeline(tiny_sd15):
    fam = wide(SD15Family, tiny_sd15[0], 24, 16)
    ref = _pipeline_latents(fam, 6, 7.5, [3, 4])
    traj = sample(fam, fam.encode_prompts(PROMPTS), fam.encode_negative("").expand(2), gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=7.5, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 12, 8)  # float32 rounding at the latents' scale (~20)
    assert (traj.final - ref).abs().max().item() <= 4e-6 * ref.abs().max().item()


@pytest.mark.parametrize("cfg", [1.0, 7.5])
def test_v_prediction_checkpoints_sample_as_their_pipeline(v_family, cfg):
    ref = _pipeline_latents(v_family, 6, cfg, [5, 6])
    cond = v_family.encode_prompts(PROMPTS)
    neg = v_family.encode_negative("").expand(2) if cfg > 1 else None
    traj = sample(v_family, cond, neg, gens([5, 6]), SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_decode_equals_the_pipeline_images(family):
    pipe, ddim = _ddim_pipeline(family)
    shipped, pipe.scheduler = pipe.scheduler, ddim
    try:
        ref = pipe(PROMPTS, height=16, width=16, num_inference_steps=4, guidance_scale=1.0, eta=0.0,
                   generator=gens([1, 2]), output_type="np").images
    finally:
        pipe.scheduler = shipped
    traj = sample(family, family.encode_prompts(PROMPTS), None, gens([1, 2]), SamplerRecipe(4, 0.0, train_steps=()))
    imgs = family.decode(traj.final)
    assert imgs.shape == (2, 16, 16, 3) and imgs.dtype == np.uint8
    assert np.abs(imgs.astype(int) - (ref * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("k", [0, 4, 9])
def test_ddim_eta_step_is_ddpos(family, k):
    """The `ddim` kernel on the flow latent is DDIMScheduler.step(η = 1, variance_noise=z) on the
    pipeline's latent, and its log-prob is ddpo-pytorch's: mean_CHW[−(x'−μ)²/(2σ_t²) − log σ_t −
    log √(2π)] with σ_t = η·sqrt(variance(t, t − 100)) — the last step's target is ᾱ_0."""
    from copy import deepcopy

    sigmas, timesteps = family.schedule(10)
    ddim = deepcopy(family.ddim)
    ddim.set_timesteps(10)
    cond = family.encode_prompts(PROMPTS)
    g = torch.Generator().manual_seed(k)
    x_vp, z = torch.randn((2, 4, 8, 8), generator=g), torch.randn((2, 4, 8, 8), generator=g)
    t = timesteps[k:k + 1]
    with torch.no_grad():
        eps = family.transformer(x_vp, t.expand(2), encoder_hidden_states=cond.prompt_embeds).sample
        ref = ddim.step(eps, int(t), x_vp, eta=1.0, variance_noise=z).prev_sample
        mean = ddim.step(eps, int(t), x_vp, eta=1.0, variance_noise=torch.zeros_like(z)).prev_sample
        v = family.velocity(x_vp * vp_norm(sigmas[k]), t, cond)
        out = flow_step(v, x_vp * vp_norm(sigmas[k]), sigmas[k], sigmas[k + 1], float(sigmas[1]), 1.0, "ddim", noise=z)
    scale = ref.abs().max().item()
    assert (out.prev_sample / vp_norm(sigmas[k + 1]) - ref).abs().max().item() <= 2e-6 * scale
    std = ddim._get_variance(int(t), int(t) - 100) ** 0.5
    assert out.std[0].item() / vp_norm(sigmas[k + 1]).item() == pytest.approx(float(std), rel=1e-4)
    lp = (-(ref - mean) ** 2 / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))
    assert torch.allclose(out.log_prob, lp.float(), rtol=0, atol=1e-3)


@pytest.mark.parametrize("sde_type,window", [("ddim", None), ("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, sde_type, window):
    """DDIM-η with every step stored (the last too: SD's grid ends at ᾱ_0 < 1), Flow-GRPO's SDE,
    CPS, and an SDE window: ratio exactly 1."""
    recipe = SamplerRecipe(steps=4, noise_level=1.0 if sde_type == "ddim" else 0.7, sde_type=sde_type,
                           guidance_scale=5.0, sde_steps=window,
                           train_steps=window or ((0, 1, 2, 3) if sde_type == "ddim" else (0, 1, 2)))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_lora_targets_and_layout_errors(family, tiny_flux, tmp_path):
    names = [n for n, _ in family.transformer.named_modules()]
    for target in SD15Family.lora_targets:
        assert any(n.endswith(target) for n in names), f"LoRA target {target} matches no module"
    with pytest.raises(ModelLoadError, match="FluxPipeline, not a StableDiffusionPipeline"):
        SD15Family.load(tiny_flux[0])
    broken = tmp_path / "no-unet"
    shutil.copytree(family.path, broken)
    shutil.rmtree(broken / "unet")
    with pytest.raises(ModelLoadError, match=r"lacks unet/ \(UNet2DConditionModel\)"):
        SD15Family.load(broken)
    cfg_file = tmp_path / "clips"
    shutil.copytree(family.path, cfg_file)
    sched = cfg_file / "scheduler" / "scheduler_config.json"
    sched.write_text(json.dumps({**json.loads(sched.read_text()), "thresholding": True}))
    with pytest.raises(ModelLoadError, match="thresholds x̂0"):
        SD15Family.load(cfg_file)


def test_two_rl_iterations_with_lora(tiny_sd15, tmp_path, prefect_harness):
    """Flow-GRPO's SDE and LoRA on the attention projections: adapter weights only move."""
    out, t = two_iterations(tiny_sd15, tmp_path, "sd15", "lora", "sampling.guidance_scale=5.0")
    assert json.loads(t["recipe"][0].as_py())["guidance_scale"] == 5.0


def test_two_ddpo_iterations_full_fine_tune(tiny_sd15, tmp_path, prefect_harness):
    """DDPO's own recipe: DDIM-η (η = 1) at every step, all 4 transitions stored and trained."""
    out, t = two_iterations(tiny_sd15, tmp_path, "sd15_ddpo", "full", "sampling.sde_type=ddim",
                            "sampling.noise_level=1.0", "sampling.window_size=null", "sampling.window_range=null",
                            "sampling.timestep_fraction=1.0", "algorithm.lora.enabled=false", algorithm="ddpo",
                            base_weights="unet/diffusion_pytorch_model.safetensors")
    recipe = json.loads(t["recipe"][0].as_py())
    assert recipe["sde_type"] == "ddim" and recipe["train_steps"] == [0, 1, 2, 3]
    assert t["timesteps"][0].as_py()[:2] == [751.0, 501.0]
    from typer.testing import CliRunner

    from pixrl.cli import app

    res = CliRunner().invoke(app, ["replay", "sd15_ddpo", "--iteration", "1", "--workdir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["equal"] is True and report["tensors"] > 0  # the update re-run from its artifacts, bit for bit


@pytest.mark.parametrize("fixture", ["family", "v_family"])
def test_offline_losses_use_the_models_own_error_and_timesteps(fixture, request):
    """DPO's and SFT's error on a DDPM family is DiffusionDPO's: t uniform over the training
    timesteps (`timesteps=ddpm`), x_t = √ᾱ x0 + √(1−ᾱ) ε, mean_CHW of the squared error of the
    UNet's own target (ε; v = √ᾱ ε − √(1−ᾱ) x0 for v-prediction) — from the flow quantities."""
    from pixrl.algorithms.diffusion_dpo import noised, prediction_error
    from pixrl.algorithms.sampling import model_timesteps

    fam = request.getfixturevalue(fixture)
    g = torch.Generator().manual_seed(1)
    sigma = fam.training_noise_levels(4, g)
    t = fam.timesteps_at(sigma)
    assert torch.allclose(t, t.round(), atol=2e-3) and torch.equal(model_timesteps(fam, sigma), t)
    x0, eps = torch.randn((4, 4, 8, 8), generator=g), torch.randn((4, 4, 8, 8), generator=g)
    cond = fam.encode_prompts(PROMPTS + PROMPTS)
    x, target = noised(x0, eps, sigma)
    with torch.no_grad():
        ours = prediction_error(fam, fam.velocity(x, t, cond), target, sigma)
        ab = fam.alpha_bar_at(t).float().reshape(-1, 1, 1, 1)
        x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
        pred = fam.transformer(x_t, t, encoder_hidden_states=cond.prompt_embeds).sample
        want = eps if fam.prediction_type == "epsilon" else ab.sqrt() * eps - (1 - ab).sqrt() * x0
        theirs = ((pred - want) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-6)


def test_offline_dpo_trains_sd15_from_its_ddpo_rollouts(tiny_sd15, tmp_path, prefect_harness):
    """`pixrl dpo --config sd15_dpo` (DiffusionDPO's SD1.5 recipe: β 5000, DDPM timesteps, the ε
    error) on pairs of this family's archived rollouts, through the real offline flow."""
    from mlflow.tracking import MlflowClient
    from typer.testing import CliRunner

    from pixrl.cli import app

    two_iterations(tiny_sd15, tmp_path, "src", "lora", "sampling.guidance_scale=5.0")
    res = CliRunner().invoke(app, ["dpo", "--from", "src", "-n", "2", "--run", "d1", "--workdir", str(tmp_path),
                                   "--config", "sd15_dpo", f"model.path={tiny_sd15[0]}", "model.resolution=16",
                                   "model.device=cpu", "model.dtype=float32", "dataset=shapes",
                                   "dpo.eval_per_category=1", "dpo.pairs_per_step=2", "sampling.eval_steps=2"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(out["run_id"])
    assert run.data.params["algorithm.timesteps"] == "ddpm" and float(run.data.params["algorithm.beta"]) == 5000
    assert run.data.tags["pixrl.algorithm"] == "diffusion_dpo" and run.data.metrics["pairs"] > 0
