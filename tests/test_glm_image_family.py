"""GLM-Image's diffusion decoder on a tiny random checkpoint written by `pixrl tiny glm_image` in
the diffusers layout (the autoregressive model, its processor, the ByT5 glyph encoder, the DiT,
the VAE): glyph embeddings and prior tokens as the pipeline computes them, each prompt's alone
and seeded by the prompt; the pipeline's σ grid with unshifted timesteps; ODE sampling equal to
GlmImagePipeline's — end to end, the pipeline sampling its own prior tokens — with and without
CFG, square and not; decoded images equal; replayed log-probs equal to the stored ones; a prior
token outside the codebook refused; a wrong directory refused; two RL iterations through the
unchanged flow with LoRA and full fine-tuning."""

import shutil

import numpy as np
import pytest
import torch

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.config.loader import load_config
from pixrl.models.base import ModelLoadError
from pixrl.models.glm_image import GlmImageFamily, prompt_seed
from pixrl.models.registry import family_of_directory, get_family

# the first quotes text: its glyph embeddings are longer than the empty string's
PROMPTS = ["a sign that says 'hello world'", "a red circle"]


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-glm-image"
    return out, GlmImageFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_glm):
    return GlmImageFamily.load(tiny_glm[0], max_sequence_length=64, resolution=64)


def _pipeline(family, prompt: str, cfg: float, seed: int, output_type: str = "latent", steps: int = 6):
    """GlmImagePipeline end to end: its autoregressive model samples the prior tokens from `seed`."""
    return family.pipe(prompt=prompt, height=family.height, width=family.width, num_inference_steps=steps,
                       guidance_scale=cfg, generator=torch.Generator().manual_seed(seed), max_sequence_length=64,
                       output_type=output_type).images


def _seeds(family, prompts=PROMPTS) -> list[int]:
    """Each prompt's prior seed, used as its sample seed too: the pipeline draws both from one generator."""
    return [prompt_seed(family.prior_seed, p) for p in prompts]


def _ode(family, cfg: float, steps: int = 6):
    neg = family.encode_negative("").expand(len(PROMPTS)) if cfg > 1 else None
    return sample(family, family.encode_prompts(PROMPTS), neg, gens(_seeds(family)),
                  SamplerRecipe(steps, 0.0, guidance_scale=cfg, train_steps=()))


def test_registered_and_found_from_its_layout(tiny_glm, family):
    assert get_family("glm_image") is GlmImageFamily and family_of_directory(tiny_glm[0]) == "glm_image"
    assert family.latent_shape() == (4, 8, 8)
    names = [n for n, _ in family.transformer.named_modules()]
    assert all(any(n.endswith(t) for n in names) for t in GlmImageFamily.lora_targets)
    assert set(family.text_towers()) == {"text_encoder", "vision_language_encoder"}


def test_encodings_are_the_pipelines_each_prompt_alone(family):
    before = torch.random.get_rng_state()
    cond = family.encode_prompts(PROMPTS)
    assert torch.equal(torch.random.get_rng_state(), before), "sampling the prior tokens moved the global RNG"
    for i, p in enumerate(PROMPTS):
        glyph = family.pipe._get_glyph_embeds([p], 64, torch.device("cpu"))
        assert int(cond.lengths[i]) == glyph.shape[1] and torch.equal(cond.glyph[i, : glyph.shape[1]], glyph[0])
        prior, _, _ = family.pipe.generate_prior_tokens([p], 64, 64, device=torch.device("cpu"),
                                                        generator=torch.Generator().manual_seed(_seeds(family)[i]))
        assert torch.equal(cond.prior[i], prior[0])
    assert cond.lengths[0] > cond.lengths[1] and cond.glyph[1, int(cond.lengths[1]):].abs().sum() == 0
    assert cond.prior.shape == (2, 16) and cond.prior.dtype == torch.int64
    alone = family.encode_prompts(PROMPTS[1:])
    assert torch.equal(alone.prior[0], cond.prior[1]) and torch.equal(alone.glyph[0, :1], cond.glyph[1, :1])
    neg = family.encode_negative("")
    assert neg.prior is None and neg.lengths.tolist() == [1]
    assert neg.select([0]).expand(2).glyph.shape[0] == 2


def test_the_prior_seed_sets_each_prompts_plan_and_the_encodings_identity(tiny_glm, family):
    other = GlmImageFamily.load(tiny_glm[0], max_sequence_length=64, resolution=64, prior_seed=7)
    a, b = family.encode_prompts(PROMPTS), other.encode_prompts(PROMPTS)
    assert not torch.equal(a.prior, b.prior) and torch.equal(a.glyph, b.glyph)
    assert family.identity() != other.identity() and other.describe()["prior_seed"] == 7
    assert torch.equal(family.encode_prompts(PROMPTS).prior, a.prior)


def test_schedule_is_the_pipelines_and_off_grid_timesteps_undo_its_shift(family):
    from copy import deepcopy

    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.glm_image.pipeline_glm_image import retrieve_timesteps

    sigmas, timesteps = family.schedule(6)
    sched = deepcopy(family.pipe.scheduler)
    raw = np.linspace(1000, 1.0, 7)[:-1].astype(np.int64).astype(np.float32)
    ref, _ = retrieve_timesteps(sched, 6, "cpu", raw, raw / 1000, mu=family._mu())
    assert torch.equal(timesteps, ref.float()) and torch.equal(sigmas, sched.sigmas.float()) and sigmas[-1] == 0
    assert not torch.allclose(sigmas[:-1] * 1000, timesteps)  # the timesteps are the unshifted ones
    shipped = family.scheduler
    for kind in [{"time_shift_type": "linear"}, {"time_shift_type": "exponential"},
                 {"use_dynamic_shifting": False, "shift": 3.0}]:
        family.scheduler = FlowMatchEulerDiscreteScheduler.from_config(shipped.config, **kind)
        try:
            s, t = family.schedule(6)
            assert torch.allclose(family.timesteps_at(s[:-1]), t, atol=1e-2), kind
            assert float(family.timesteps_at(torch.tensor(0.0))) == 0.0
        finally:
            family.scheduler = shipped


@pytest.mark.parametrize("cfg", [1.0, 1.5, 4.0])
def test_ode_sampling_equals_the_pipeline_end_to_end(family, cfg):
    ref = torch.cat([_pipeline(family, p, cfg, s) for p, s in zip(PROMPTS, _seeds(family))])
    traj = _ode(family, cfg)
    assert traj.final.shape == ref.shape == (2, 4, 8, 8)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_a_non_square_image_equals_the_pipeline(tiny_glm):
    fam = wide(GlmImageFamily, tiny_glm[0], 64, 128, max_sequence_length=64)
    assert fam.encode_prompts(PROMPTS[:1]).prior.shape == (1, 4 * 8)
    ref = torch.cat([_pipeline(fam, p, 1.5, s) for p, s in zip(PROMPTS, _seeds(fam))])
    traj = sample(fam, fam.encode_prompts(PROMPTS), fam.encode_negative("").expand(2), gens(_seeds(fam)),
                  SamplerRecipe(6, 0.0, guidance_scale=1.5, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 8, 16)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_decoded_images_equal_the_pipelines(family):
    ref = np.concatenate([_pipeline(family, p, 1.5, s, "np") for p, s in zip(PROMPTS, _seeds(family))])
    images = family.decode(_ode(family, 1.5).final)
    assert images.shape == (2, 64, 64, 3) and images.dtype == np.uint8
    assert np.abs(images.astype(int) - (np.asarray(ref) * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=1.5, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_a_prior_token_outside_the_codebook_is_refused(tiny_glm):
    fam = GlmImageFamily.load(tiny_glm[0], max_sequence_length=64, resolution=64)
    ar = fam.pipe.vision_language_encoder
    start = ar.config.image_start_token_id
    ar.generation_config.suppress_tokens = None  # a sampler free to emit the image marks …
    with torch.no_grad():
        ar.lm_head.weight[start] = 1e3 * ar.lm_head.weight[start].sign()  # … and one that does
    with pytest.raises(ValueError, match="outside its 64-entry codebook inside the image of 'a red circle'"):
        fam.encode_prompts(["a red circle"])


def test_a_wrong_or_partial_directory_is_refused(tiny_glm, tmp_path, tiny_sd15):
    with pytest.raises(ModelLoadError, match="holds a StableDiffusionPipeline, not a GlmImagePipeline"):
        GlmImageFamily.load(tiny_sd15[0])
    partial = tmp_path / "partial"
    shutil.copytree(tiny_glm[0], partial)
    shutil.rmtree(partial / "vision_language_encoder")
    with pytest.raises(ModelLoadError, match=r"lacks vision_language_encoder/ \(GlmImageForConditionalGeneration\)"):
        GlmImageFamily.load(partial)
    with pytest.raises(ModelLoadError, match="model.resolution=48: this glm_image checkpoint needs each side a multiple of 32"):
        GlmImageFamily.load(tiny_glm[0], resolution=48)
    with pytest.raises(ModelLoadError, match="model.frame_rate: the glm_image family has no such setting"):
        GlmImageFamily.load(tiny_glm[0], frame_rate=3)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_rl_iterations_through_the_unchanged_flow(tiny_glm, tmp_path, prefect_harness, mode):
    out, t = two_iterations(tiny_glm, tmp_path, f"glm_{mode}", mode, "sampling.guidance_scale=1.5",
                            "model.prior_seed=3")
    assert t["final_latent"].type.shape == [4, 8, 8]


def test_the_presets_sample_as_the_pipeline_does():
    cfg = load_config("glm_image_ocr", ["model.path=/x"])
    assert (cfg.model.family, cfg.model.resolution, cfg.model.max_sequence_length) == ("glm_image", 1024, 2048)
    assert cfg.sampling.guidance_scale == 1.5 and cfg.sampling.negative_prompt == "" and cfg.sampling.eval_steps == 50
    assert cfg.algorithm.lora.rank == 64 and cfg.reward.weights == {"ocr": 1.0}
