"""SkyReels-V1-Hunyuan-I2V on a tiny random checkpoint written by `pixrl tiny skyreels_i2v` in the
diffusers layout: the first-frame latents equal HunyuanSkyreelsImageToVideoPipeline's (at the
posterior mode), ODE sampling equals the pipeline's without and with true CFG, the first frame
reaches the velocity, replayed log-probs equal the stored ones, a trainer rank without towers
replays with the rollout's encodings, the refusals, and two RL iterations through the unchanged
flow (rows keep their first frames)."""

import io
import json

import pytest
import torch
from PIL import Image

from conftest import two_iterations
from family_checks import assert_needs_its_source_images, assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.artifacts.media import decode_media
from pixrl.engines.prompt_cache import PromptCache
from pixrl.models.base import ModelLoadError
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.skyreels_i2v import SkyReelsI2VFamily
from pixrl.models.source_images import condition_keys, source_pixels

PROMPTS = ["the red circle drifts to the right", "the camera zooms in"]
PIPELINE_MODULE = "diffusers.pipelines.hunyuan_video.pipeline_hunyuan_skyreels_image2video"


@pytest.fixture(scope="module")
def tiny_sr(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-skyreels-i2v"
    return out, SkyReelsI2VFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_sr):
    return SkyReelsI2VFamily.load(tiny_sr[0], max_sequence_length=64, resolution=32, frames=5)


@pytest.fixture(scope="module")
def frames(tiny_sr):
    return [(tiny_sr[0] / "first_frames" / f"frame_{i}.png").read_bytes() for i in range(2)]


@pytest.fixture
def posterior_mode(monkeypatch):
    """The pipeline's first-frame latents at the posterior mode, as the family takes them (it draws
    a posterior sample from the clip's generator before the noise)."""
    import importlib

    monkeypatch.setattr(importlib.import_module(PIPELINE_MODULE), "retrieve_latents",
                        lambda out, generator=None, sample_mode="sample": out.latent_dist.mode())


def _pipeline(family, frames, cfg, seeds, negative: str = ""):
    """The pipeline at true-CFG scale `cfg` on its negative prompt, one prompt and frame a call."""
    neg = {"negative_prompt": negative} if cfg > 1 else {}
    out = [family.pipe(image=source_pixels(family, frames[i], torch.float32)[0], prompt=[p], true_cfg_scale=cfg,
                       guidance_scale=1.0, num_inference_steps=6, generator=gens([s]), output_type="latent",
                       height=family.height, width=family.width, num_frames=5, max_sequence_length=64, **neg).frames
           for i, (p, s) in enumerate(zip(PROMPTS, seeds))]
    return torch.cat(out)


def test_registered_and_found_from_its_layout(tiny_sr, family):
    assert get_family("skyreels_i2v") is SkyReelsI2VFamily and SkyReelsI2VFamily.needs_images
    assert family_of_directory(tiny_sr[0]) == "skyreels_i2v"
    assert family.latent_shape() == (4, 2, 4, 4) and family.transformer.config.in_channels == 8


def test_first_frame_latents_are_the_pipelines(family, frames, posterior_mode):
    cond = family.encode_prompts(PROMPTS, frames)
    for i, im in enumerate(frames):
        picture = Image.open(io.BytesIO(im)).convert("RGB")
        pixels = family.pipe.video_processor.preprocess(picture, height=32, width=32).to(torch.float32)
        _, want = family.pipe.prepare_latents(pixels, 1, 4, 32, 32, 5, torch.float32, "cpu", gens([0]))
        assert torch.equal(cond.condition[i:i + 1], want)
    assert cond.condition.shape == (2, 4, 2, 4, 4) and cond.condition[:, :, 1:].eq(0).all()
    assert cond.condition[:, :, 0].abs().sum() > 0


@pytest.mark.parametrize("cfg,negative", [(1.0, ""), (6.0, ""), (6.0, "Aerial view, overexposed, low quality")])
def test_ode_sampling_equals_the_pipeline(family, frames, cfg, negative, posterior_mode):
    """The last case: the start of SkyReels-V1's model-card negative prompt."""
    _ode_equals_the_pipeline(family, frames, cfg, negative)


def test_non_square_ode_equals_the_pipeline(tiny_sr, frames, posterior_mode):
    _ode_equals_the_pipeline(wide(SkyReelsI2VFamily, tiny_sr[0], 32, 48, max_sequence_length=64, frames=5), frames,
                             6.0, "")


def _ode_equals_the_pipeline(family, frames, cfg, negative):
    cond = family.encode_prompts(PROMPTS, frames)
    neg = family.encode_negative(negative).expand(2) if cfg > 1 else None
    ref = _pipeline(family, frames, cfg, [3, 4], negative)
    recipe = SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=())
    traj = sample(family, cond, neg, gens([3, 4]), recipe)
    other = sample(family, family.encode_prompts(PROMPTS, frames[::-1]), neg, gens([3, 4]), recipe)
    assert traj.final.shape == ref.shape == (2, *family.latent_shape())
    assert (traj.final - ref).abs().max().item() <= 1e-5
    assert (other.final - traj.final).abs().max().item() > 1e-4  # the first frame reaches the velocity


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("sde", (1, 2)), ("dance", None)])
def test_replayed_log_probs_equal_stored_with_cfg(family, frames, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=6.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2),
                               recipe)


def test_a_trainer_rank_without_towers_replays_with_the_rollouts_encodings(tiny_sr, family, frames):
    bare = SkyReelsI2VFamily.load(tiny_sr[0], max_sequence_length=64, resolution=32, frames=5, text_towers=False)
    assert bare.pipe.text_encoder is None and not bare.text_towers()
    keys = condition_keys(PROMPTS, frames)
    held = PromptCache.holding(bare, PromptCache(family).encodings([keys], negative="", images=frames))
    (cond, pos), neg = held.encode(keys), held.negative("")
    want, want_pos = PromptCache(family).encode(keys, frames)
    x = torch.randn((2, *family.latent_shape()), generator=torch.Generator().manual_seed(0))
    t = family.schedule(4)[1][1].repeat(2)
    with torch.no_grad():
        v_bare = bare.velocity(x, t, cond.select([pos[k] for k in keys]), 6.0, neg.expand(2))
        v_full = family.velocity(x, t, want.select([want_pos[k] for k in keys]), 6.0,
                                 family.encode_negative("").expand(2))
    assert torch.equal(v_bare, v_full)


def test_refusals_name_the_fix(family, tmp_path):
    assert_needs_its_source_images(family, PROMPTS, 900.0)
    from diffusers import HunyuanSkyreelsImageToVideoPipeline, HunyuanVideoTransformer3DModel

    t2v = HunyuanVideoTransformer3DModel.from_config({**family.transformer.config, "in_channels": 4})
    HunyuanSkyreelsImageToVideoPipeline(**{**family.pipe.components, "transformer": t2v}).save_pretrained(
        str(tmp_path / "t2v"))
    with pytest.raises(ModelLoadError, match="reads 4 channels.*model.family=hunyuan_video"):
        SkyReelsI2VFamily.load(tmp_path / "t2v", max_sequence_length=64, resolution=32, frames=5)


def test_two_rl_iterations_through_the_unchanged_flow(tiny_sr, tmp_path, prefect_harness):
    out, t = two_iterations(tiny_sr, tmp_path, "sr", "lora", "sampling.guidance_scale=6.0")
    folder = tiny_sr[0] / "first_frames"
    files = {json.loads(ln)["prompt"]: (folder / json.loads(ln)["image"]).read_bytes()
             for ln in (folder / "prompts.jsonl").read_text().splitlines()}
    assert all(img == files[p] for p, img in zip(t["prompt"].to_pylist(), t["source_image"].to_pylist()))
    assert decode_media(t["image"][0].as_py()).shape == (5, 32, 32, 3)
