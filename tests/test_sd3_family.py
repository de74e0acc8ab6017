"""The SD3 family on a tiny random checkpoint saved in the diffusers layout: loader, ODE parity
with diffusers' StableDiffusion3Pipeline, and the on-policy ratio of replayed log-probs."""

import subprocess
import sys

import pytest
import torch

from pixrl.algorithms.losses import ppo_clip_loss
from family_checks import gens
from pixrl.algorithms.sampling import SamplerRecipe, replay_step, sample
from pixrl.models.registry import UnknownFamilyError, get_family, registered_families
from pixrl.models.sd3 import ModelLoadError, SD3Family
from pixrl.models.taxonomy import PolicyStep, Regime


@pytest.fixture(scope="module")
def family(tiny_checkpoint):
    return SD3Family.load(tiny_checkpoint, max_sequence_length=0)


def test_registry_and_taxonomy():
    assert get_family("sd3") is SD3Family
    assert SD3Family.semantics.regime is Regime.full_sequence and SD3Family.semantics.step is PolicyStep.denoise
    with pytest.raises(UnknownFamilyError, match="registered families: cogvideox, cogvideox_i2v, cosmos2, cosmos25, cosmos2_v2w, flux1, flux1_kontext, flux2, flux2_klein, glm_image, glm_image_ar, hunyuan_image, hunyuan_video, hunyuan_video15, hunyuan_video15_i2v, janus_pro, ltx2, ltx2_i2v, ltx_video, ltx_video_i2v, lumina2, mochi, pixart_sigma, qwen_image, qwen_image21, qwen_image_edit, qwen_image_edit_plus, sana, sd15, sd3, sdxl, skyreels_i2v, wan, wan_i2v, wan_ti2v, z_image"):
        get_family("flux-typo")
    assert "sd3" in registered_families()


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="model_index.json"):
        SD3Family.load(tmp_path / "nowhere")


def test_preflight_checks_the_checkpoint_without_importing_model_code():
    """Preflight compares each component's saved config with model_index.json without importing
    the component classes: the CLIP towers' modeling code is seconds of import that the model
    load pays later anyway, so preflight (and a refused config) stays fast."""
    code = ("import sys; from pixrl.config.loader import load_config; from pixrl.stages.preflight import preflight; "
            "preflight(load_config(None, [])); "
            "print(sorted(m for m in sys.modules if '.modeling_' in m or m.startswith(('diffusers', 'transformers.models.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("guidance,negative", [(1.0, ""), (3.0, ""), (3.0, "blurry, low quality")])
def test_ode_sampling_equals_diffusers_pipeline(family, guidance, negative):
    prompts = ["a red circle", "two blue squares"]
    seeds = [11, 12]
    steps = 6
    pipe = family.pipe
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    ref = pipe(prompt=prompts, negative_prompt=[negative] * 2, num_inference_steps=steps, guidance_scale=guidance,
               generator=gens, output_type="latent", max_sequence_length=0).images
    cond = family.encode_prompts(prompts)
    neg = family.encode_negative(negative).expand(2) if guidance > 1 else None
    recipe = SamplerRecipe(steps=steps, noise_level=0.0, guidance_scale=guidance, train_steps=(),
                           negative_prompt=negative)
    traj = sample(family, cond, neg, [torch.Generator().manual_seed(s) for s in seeds], recipe)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_non_square_ode_equals_the_pipeline(tiny_checkpoint, family):
    side = family.height  # the largest the tiny checkpoint's positional table holds
    with pytest.raises(ModelLoadError, match=f"model.height={side}, model.width={2 * side}: .*at most {side}"):
        SD3Family.load(tiny_checkpoint, max_sequence_length=0, resolution=(side, 2 * side))
    fam = SD3Family.load(tiny_checkpoint, max_sequence_length=0, resolution=(side // 2, side))
    prompts, seeds = ["a red circle", "two blue squares"], [11, 12]
    ref = fam.pipe(prompt=prompts, negative_prompt=[""] * 2, num_inference_steps=6, guidance_scale=3.0,
                   height=fam.height, width=fam.width, generator=gens(seeds), output_type="latent",
                   max_sequence_length=0).images
    traj = sample(fam, fam.encode_prompts(prompts), fam.encode_negative("").expand(2), gens(seeds),
                  SamplerRecipe(steps=6, noise_level=0.0, guidance_scale=3.0, train_steps=()))
    f = fam.pipe.vae_scale_factor
    assert traj.final.shape == ref.shape and ref.shape[-2:] == (side // 2 // f, side // f)
    assert (traj.final - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("sde_type,guidance", [("sde", 1.0), ("sde", 2.0), ("cps", 1.0)])
def test_replayed_log_probs_equal_stored(family, sde_type, guidance):
    """Unchanged weights, same micro-batch geometry, fp32 → ratio exactly 1 at every stored step."""
    prompts = ["a red circle", "a circle above a square", "three triangles", "a green square"]
    recipe = SamplerRecipe(steps=5, noise_level=0.7, sde_type=sde_type, guidance_scale=guidance,
                           train_steps=(0, 1, 2, 3))
    cond = family.encode_prompts(prompts)
    neg = family.encode_negative("").expand(4) if guidance > 1 else None
    traj = sample(family, cond, neg, [torch.Generator().manual_seed(i) for i in range(4)], recipe)
    assert traj.latents.shape == (4, 4, *family.latent_shape())
    for j, k in enumerate(traj.stored_steps):
        out = replay_step(family, traj.latents[:, j], traj.next_latents[:, j], k, traj.sigmas, traj.timesteps,
                          cond, neg, recipe)
        assert torch.equal(out.log_prob.detach(), traj.log_probs[:, j])
        loss, m = ppo_clip_loss(out.log_prob, traj.log_probs[:, j], torch.ones(4), 1e-4)
        assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0
        loss.backward()  # the replay graph reaches the transformer
    assert any(p.grad is not None for p in family.transformer.parameters())
    family.transformer.zero_grad(set_to_none=True)


def test_sample_is_reproducible_from_seed_alone(family):
    """A sample's trajectory depends on its seed, not on the batch it ran in (up to fp rounding)."""
    recipe = SamplerRecipe(steps=4, noise_level=0.7, train_steps=(0, 1, 2))
    c2 = family.encode_prompts(["a red circle", "a blue square"])
    both = sample(family, c2, None, [torch.Generator().manual_seed(s) for s in (5, 6)], recipe)
    alone = sample(family, c2.select([1]), None, [torch.Generator().manual_seed(6)], recipe)
    assert torch.allclose(both.final[1], alone.final[0], atol=1e-5)


def test_decode_gives_uint8_images(family):
    imgs = family.decode(torch.zeros(2, *family.latent_shape()))
    assert imgs.shape == (2, 16, 16, 3) and imgs.dtype.name == "uint8"
