"""The unguided training forward of the forward-process algorithms (DiffusionNFT, DGPO, online
SFT, online DPO's pairs): a CFG family's is the conditional velocity whatever the rollout's CFG
scale; a guidance-distilled family's (FLUX.1-dev: the scale is a transformer input) is at the
rollout's scale — at 1 it would train a model the rollout never ran."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.diffusion_dpo import pair_loss
from pixrl.algorithms.diffusion_nft import nft_policy_loss, optimality
from pixrl.algorithms.replay import ReplayPolicy
from pixrl.algorithms.sampling import SamplerRecipe, conditional_scale, generators, sample
from pixrl.config.schema import AlgorithmConfig
from pixrl.models.flux import FluxFamily
from pixrl.models.sd3 import SD3Family
from pixrl.stages.offline import OfflineError, training_recipe

PROMPTS = ["a red circle", "a red circle", "two blue squares", "two blue squares"]
SETTINGS = {"diffusion_nft": {}, "online_sft": {}, "dgpo": {"clip_dsm": False, "switch_ema_ref": None, "trunc_steps": 2, "train_levels": 2},
            "diffusion_dpo": {}, "diffusion_sft": {}}  # the offline two: the recipe the archive's rows give


@pytest.fixture(scope="module")
def flux(tiny_flux):
    return FluxFamily.load(tiny_flux[0])


@pytest.fixture(scope="module")
def sd3(tiny_checkpoint):
    return SD3Family.load(tiny_checkpoint, max_sequence_length=0)


def _batch(family, cond):
    x0 = sample(family, cond, None, generators([1, 2, 3, 4]), SamplerRecipe(4, 0.0, train_steps=())).final
    return {"final_latent": x0.numpy(), "advantage": np.array([1.0, -1.0, 0.5, -0.5], dtype=np.float32),
            "group_id": np.array([0, 0, 1, 1], dtype=np.int32), "timesteps": [family.schedule(4)[1].numpy()] * 4}


def _terms(name, family, scale, batch, cond):
    algo = build_algorithm(AlgorithmConfig(name=name, optimizer_steps_per_iteration=1, **SETTINGS[name]))
    sigmas, timesteps = family.schedule(4)
    recipe = SamplerRecipe(4, 0.0, train_steps=(), guidance_scale=scale)
    policy = ReplayPolicy(family, family, cond, None, sigmas, timesteps, recipe, torch.device("cpu"),
                          torch.Generator().manual_seed(5), sampler=family,
                          frozen={slot: family for slot in algo.frozen_slots()})
    algo.prepare_update(batch)
    with torch.no_grad():  # the first term
        loss, metrics = next(iter(algo.losses(batch, policy)))
    # Diffusion-DPO against a reference equal to the policy is ln 2 at any scale: its forward's error
    return float(metrics["err_w"] if name == "diffusion_dpo" else loss)


def test_the_scale_of_a_conditional_forward(flux, sd3):
    recipe = SamplerRecipe(4, 0.0, guidance_scale=3.5)
    assert conditional_scale(flux, recipe) == 3.5
    assert conditional_scale(sd3, recipe) == 1.0
    assert conditional_scale(flux, None) == 1.0  # no rollout recipe


def test_an_offline_update_trains_a_distilled_family_at_its_archived_scale(flux, sd3):
    """The offline stage layer's recipe: the archived rows' (one scale) for FLUX, none for SD3;
    rows of several scales, or without a recipe, are refused naming the fix."""
    at = lambda g: json.dumps(SamplerRecipe(4, 0.7, guidance_scale=g).to_dict())  # noqa: E731
    recipe = training_recipe(FluxFamily, [at(3.5), at(3.5)])
    assert conditional_scale(flux, recipe) == 3.5
    assert training_recipe(SD3Family, [at(4.5), at(7.0)]) is None
    with pytest.raises(OfflineError, match=r"guidance scales \[2.5, 3.5\].*narrow dpo.source"):
        training_recipe(FluxFamily, [at(3.5), at(2.5)])
    with pytest.raises(OfflineError, match="no sampler recipe"):
        training_recipe(FluxFamily, [at(3.5), None])


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_training_forwards_follow_the_rollouts_embedded_scale_and_ignore_cfg(name, flux, sd3):
    cond = flux.encode_prompts(PROMPTS)
    batch = _batch(flux, cond)
    at_rollout, at_one = _terms(name, flux, 3.5, batch, cond), _terms(name, flux, 1.0, batch, cond)
    assert np.isfinite(at_rollout) and at_rollout != at_one
    cond = sd3.encode_prompts(PROMPTS)
    batch = _batch(sd3, cond)
    assert _terms(name, sd3, 4.5, batch, cond) == _terms(name, sd3, 1.0, batch, cond)


def test_a_diffusion_nft_term_on_flux_is_the_loss_at_the_rollouts_scale(flux):
    """DiffusionNFT's first term, written out with every forward at the rollout's guidance 3.5."""
    cond = flux.encode_prompts(PROMPTS)
    batch = _batch(flux, cond)
    got = _terms("diffusion_nft", flux, 3.5, batch, cond)
    algo = build_algorithm(AlgorithmConfig(name="diffusion_nft"))
    s = algo.settings
    sigmas, timesteps = flux.schedule(4)
    x0 = torch.from_numpy(batch["final_latent"]).float()
    gen = torch.Generator().manual_seed(5)
    order = torch.stack([torch.randperm(4, generator=gen) for _ in range(4)])
    idx = order[:, 0]
    t, timestep = sigmas[idx].float(), timesteps[idx]
    noise = torch.randn(x0.shape, generator=gen)
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    with torch.no_grad():
        v = flux.velocity(x_t, timestep, cond, 3.5, None).float()
        want, _ = nft_policy_loss(v, v, x_t, x0, t, optimality(torch.from_numpy(batch["advantage"]), s.adv_clip_max),
                                  s.beta, s.adv_clip_max)
        if s.kl_weight > 0:
            want = want + s.kl_weight * ((v - v) ** 2).mean()
    assert got == pytest.approx(float(want), abs=1e-7)


def test_online_dpo_pairs_follow_the_rollouts_embedded_scale(flux):
    cond = flux.encode_prompts(PROMPTS)
    x0 = torch.from_numpy(_batch(flux, cond)["final_latent"])
    settings = build_algorithm(AlgorithmConfig(name="online_dpo")).settings

    def loss(scale):
        policy = ReplayPolicy(flux, flux, cond, None, None, None, SamplerRecipe(4, 0.0, guidance_scale=scale),
                              torch.device("cpu"), torch.Generator().manual_seed(7))
        with torch.no_grad():
            return pair_loss(x0[:2], x0[2:], cond, settings, policy)[1]

    assert loss(3.5) != loss(1.0)


def test_dgpo_refuses_a_guided_reference_on_a_guidance_distilled_family(flux):
    algo = build_algorithm(AlgorithmConfig(name="dgpo", kl_guidance=4.5, optimizer_steps_per_iteration=1))
    with pytest.raises(ValueError, match="guidance-distilled.*kl_guidance=1"):
        algo.check_family(flux)


def test_diffusion_nft_is_cfg_free_on_a_cfg_family_and_keeps_a_distilled_familys_scale(flux, sd3):
    """Preflight refuses a CFG scale for DiffusionNFT on SD3; FLUX.1-dev samples at its embedded
    scale (its rollout recipe carries it, and training follows it)."""
    from pixrl.config.loader import load_config
    from pixrl.stages.preflight import check_online_algorithm

    algo = build_algorithm(AlgorithmConfig(name="diffusion_nft"))
    cfg = load_config(None, ["algorithm=diffusion_nft", "sampling.guidance_scale=4.5"])
    with pytest.raises(ValueError, match="CFG-free: set sampling.guidance_scale=1"):
        check_online_algorithm(cfg, algo, sd3)
    check_online_algorithm(cfg.model_copy(update={"sampling": cfg.sampling.model_copy(update={"guidance_scale": 1.0})}),
                           algo, sd3)
    flux_cfg = load_config(None, ["algorithm=diffusion_nft", "sampling.guidance_scale=3.5", "model.family=flux1"])
    check_online_algorithm(flux_cfg, algo, flux)
    recipe = algo.rollout_recipe(flux_cfg.sampling, np.random.default_rng(0), "denoise", 0)
    assert recipe.guidance_scale == 3.5 and recipe.noise_level == 0 and conditional_scale(flux, recipe) == 3.5

