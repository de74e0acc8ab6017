"""PixArt-Σ on a tiny random checkpoint written by `pixrl tiny pixart_sigma` in the diffusers layout:
T5 encodings and masks equal the pipeline's, the DDIM grid (trailing, for the shipped linspace
DPM-Solver) as flow noise levels, ODE sampling equal to PixArtSigmaPipeline given that DDIMScheduler
with and without CFG, decoded images equal, the learned-variance half dropped, DDPO's DDIM-η and
the flow kernels replayed exactly, DPO's ε error, and RL iterations through the unchanged flow
(LoRA with Flow-GRPO, full fine-tuning with DDPO)."""

import numpy as np
import pytest
import torch

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.models.base import ModelLoadError
from pixrl.models.pixart_sigma import PixArtSigmaFamily
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.sd15 import sigma_of_alpha_bar

PROMPTS = ["a red circle", "two blue squares in the sky"]


@pytest.fixture(scope="module")
def tiny_px(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-pixart-sigma"
    return out, PixArtSigmaFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_px):
    return PixArtSigmaFamily.load(tiny_px[0], max_sequence_length=64, resolution=32)


def _pipeline(family, cfg: float, seeds, output_type: str = "latent", steps: int = 10, negative: str = ""):
    """PixArtSigmaPipeline on DDIM with trailing spacing (η = 0), no caption cleaning or binning."""
    from diffusers import DDIMScheduler

    pipe = family.pipe
    shipped = pipe.scheduler
    pipe.scheduler = DDIMScheduler.from_config(shipped.config, timestep_spacing="trailing", clip_sample=False)
    try:
        return pipe(prompt=PROMPTS, negative_prompt=[negative] * len(PROMPTS), num_inference_steps=steps, generator=gens(seeds), guidance_scale=cfg, eta=0.0,
                    output_type=output_type, height=family.height, width=family.width, max_sequence_length=64,
                    clean_caption=False,
                    use_resolution_binning=False).images
    finally:
        pipe.scheduler = shipped


def test_registered_and_found_from_its_layout(tiny_px, family):
    assert get_family("pixart_sigma") is PixArtSigmaFamily and family.variance_preserving
    assert family_of_directory(tiny_px[0]) == "pixart_sigma"
    assert family.latent_shape() == (4, 16, 16) and family.learned_sigma
    assert type(family.pipe.scheduler).__name__ == "DPMSolverMultistepScheduler"  # as shipped; rollouts use DDIM
    names = [n for n, _ in family.transformer.named_modules()]
    assert all(any(n.endswith(t) for n in names) for t in PixArtSigmaFamily.lora_targets)


def test_encodings_and_masks_are_the_pipelines(family):
    cond = family.encode_prompts(PROMPTS)
    embeds, mask, neg, neg_mask = family.pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=True, device="cpu",
                                                             clean_caption=False, max_sequence_length=64)
    assert torch.equal(cond.prompt_embeds, embeds) and torch.equal(cond.mask, mask)
    empty = family.encode_prompts([""])
    assert torch.equal(empty.prompt_embeds, neg[:1]) and torch.equal(empty.mask, neg_mask[:1])
    assert cond.mask.shape == (2, 64) and cond.mask[0].sum() < cond.mask[1].sum()


def test_schedule_is_the_trailing_ddim_grid_as_flow_noise_levels(family):
    sigmas, timesteps = family.schedule(10)
    assert timesteps.tolist() == list(range(999, 0, -100))  # trailing: 999, 899, …, 99
    alpha_bar = family.ddim.alphas_cumprod.double()
    assert torch.allclose(sigmas[:-1].double(), sigma_of_alpha_bar(alpha_bar[timesteps.long()]), atol=1e-6)
    assert sigmas[-1] == 0  # set_alpha_to_one: the DPM config does not set it, DDIM's default
    with pytest.raises(ValueError, match="choose a step count that divides 1000"):
        family.schedule(30)


@pytest.mark.parametrize("cfg,negative", [(1.0, ""), (4.5, ""), (4.5, "blurry, low quality")])
def test_ode_sampling_equals_the_pipeline_with_ddim(family, cfg, negative):
    """Euler on the flow grid is DDIM (η = 0). The random ε-model's latents reach hundreds (x̂0
    divides by √ᾱ at the first steps), so float32 rounding is compared relative to that scale."""
    ref = _pipeline(family, cfg, [3, 4], negative=negative)
    neg = family.encode_negative(negative).expand(2) if cfg > 1 else None
    traj = sample(family, family.encode_prompts(PROMPTS), neg, gens([3, 4]),
                  SamplerRecipe(10, 0.0, guidance_scale=cfg, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 16, 16)
    assert (traj.final - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()


def test_non_square_ode_equals_the_pipeline(tiny_px):
    fam = wide(PixArtSigmaFamily, tiny_px[0], 32, 48, max_sequence_length=64)
    ref = _pipeline(fam, 4.5, [3, 4])
    traj = sample(fam, fam.encode_prompts(PROMPTS), fam.encode_negative("").expand(2), gens([3, 4]),
                  SamplerRecipe(10, 0.0, guidance_scale=4.5, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 16, 24)
    assert (traj.final - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()


def test_decoded_images_equal_the_pipelines(family):
    ref = _pipeline(family, 4.5, [5, 6], output_type="np")
    traj = sample(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), gens([5, 6]),
                  SamplerRecipe(10, 0.0, guidance_scale=4.5, train_steps=()))
    images = family.decode(traj.final)
    assert images.shape == (2, 32, 32, 3) and images.dtype == np.uint8
    assert np.abs(images.astype(int) - (np.asarray(ref) * 255).round().astype(int)).max() <= 1


def test_the_learned_variance_half_is_dropped(family):
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([500.0, 500.0])
    cond = family.encode_prompts(PROMPTS)
    with torch.no_grad():
        full = family.transformer(x, encoder_hidden_states=cond.prompt_embeds, encoder_attention_mask=cond.mask,
                                  timestep=t, added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample
        eps = family.unet_output(x, t, cond)
    assert full.shape[1] == 8 and torch.equal(eps, full[:, :4].float())


@pytest.mark.parametrize("sde_type,window", [("ddim", None), ("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, sde_type, window):
    recipe = SamplerRecipe(steps=10, noise_level=1.0 if sde_type == "ddim" else 0.7, sde_type=sde_type,
                           guidance_scale=4.5, sde_steps=window, train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_dpo_error_is_the_transformers_epsilon_error(family):
    from pixrl.algorithms.diffusion_dpo import noised, prediction_error

    g = torch.Generator().manual_seed(1)
    sigma = family.training_noise_levels(2, g)
    t = family.timesteps_at(sigma)
    x0, eps = torch.randn((2, 4, 16, 16), generator=g), torch.randn((2, 4, 16, 16), generator=g)
    cond = family.encode_prompts(PROMPTS)
    x, target = noised(x0, eps, sigma)
    with torch.no_grad():
        ours = prediction_error(family, family.velocity(x, t, cond), target, sigma)
        ab = family.alpha_bar_at(t).float().reshape(-1, 1, 1, 1)
        x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
        pred = family.unet_output(x_t, t, cond)
        theirs = ((pred - eps) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-6)


def test_a_wrong_layout_is_refused(tiny_sd15):
    with pytest.raises(ModelLoadError, match="holds a StableDiffusionPipeline, not a PixArtSigmaPipeline"):
        PixArtSigmaFamily.load(tiny_sd15[0])


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_rl_iterations_through_the_unchanged_flow(tiny_px, tmp_path, prefect_harness, mode):
    if mode == "lora":  # Flow-GRPO with LoRA at CFG 4.5
        two_iterations(tiny_px, tmp_path, "px", "lora", "sampling.guidance_scale=4.5")
    else:  # DDPO's DDIM-η, fully fine-tuned; the last step lands on ᾱ = 1 (σ = 0), deterministic: not stored
        two_iterations(tiny_px, tmp_path, "px-ddpo", "full", "sampling.sde_type=ddim", "sampling.noise_level=1.0",
                       "sampling.window_size=null", "sampling.window_range=null", "sampling.timestep_fraction=0.75",
                       "sampling.guidance_scale=4.5", "algorithm.min_count=4", "algorithm.lora.enabled=false",
                       algorithm="ddpo")


def test_a_lora_version_exports_merged_and_refuses_a_loaderless_adapter(tiny_px, tmp_path):
    """PixArtTransformer2DModel has no diffusers LoRA loader: a bare adapter is refused before
    anything is written, the merged export loads with PixArtSigmaPipeline.from_pretrained alone."""
    import json

    from diffusers import PixArtSigmaPipeline
    from typer.testing import CliRunner

    from pixrl.artifacts.checkpoints import save_checkpoint
    from pixrl.cli import app
    from pixrl.config.loader import load_config
    from pixrl.engines.policy import TrainablePolicy

    cfg = load_config(None, [f"{k}={v}" for k, v in tiny_px[1].items()] + [
        f"run.workdir={tmp_path}", "algorithm.lora.enabled=true", "algorithm.lora.rank=4", "algorithm.lora.alpha=8"])
    pol = TrainablePolicy(cfg)
    g = torch.Generator().manual_seed(1)
    weights = {k: v.detach() + 0.05 * torch.randn(v.shape, generator=g) for k, v in pol.trainable_parameters().items()}
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, weights, {}, {"iteration": 0}, cfg.model_dump(mode="json"))
    res = CliRunner().invoke(app, ["export-model", "--checkpoint", str(ckpt), "--out", str(tmp_path / "lora")])
    assert res.exit_code != 0 and "no LoRA loader" in res.output and "--merge" in res.output
    assert not (tmp_path / "lora").exists() and not list(tmp_path.glob("lora.staging-*"))
    res = CliRunner().invoke(app, ["export-model", "--checkpoint", str(ckpt), "--out", str(tmp_path / "merged"),
                                   "--merge"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "merged" / "pixrl_export.json").read_text())["format"] == "diffusers-pipeline"
    pol.load_version(ckpt)  # the exported version in the policy itself
    merged = PixArtSigmaPipeline.from_pretrained(str(tmp_path / "merged")).transformer
    x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([500.0, 500.0])
    cond = pol.family.encode_prompts(PROMPTS)
    kw = dict(encoder_hidden_states=cond.prompt_embeds, encoder_attention_mask=cond.mask, timestep=t,
              added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    with torch.no_grad():
        want, got = pol.module(x, **kw).sample, merged(x, **kw).sample
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
