"""CogVideoX image-to-video on a tiny random CogVideoX1.5-I2V-shaped checkpoint written by `pixrl
tiny cogvideox_i2v`: the first-frame condition is the pipeline's `prepare_latents` from the
posterior's mode (its 1.5 padding included), ODE latents equal CogVideoXImageToVideoPipeline's
(given the mode: it samples the posterior) with and without CFG, another frame changes the clip,
replayed log-probs equal the stored ones, the refusals, and two RL iterations through the flow."""

import io
import json

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from conftest import two_iterations
from family_checks import assert_needs_its_source_images, assert_replay_is_on_policy, gens
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.artifacts.media import decode_media
from pixrl.cli import app
from pixrl.models.base import ModelLoadError
from pixrl.models.cogvideox_i2v import CogVideoXI2VFamily
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.source_images import source_pixels

PROMPTS = ["the red circle drifts to the right", "the camera zooms in"]


@pytest.fixture(scope="module")
def tiny_cvx_i2v(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-cogvideox-i2v"
    return out, CogVideoXI2VFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_cvx_i2v):
    return CogVideoXI2VFamily.load(tiny_cvx_i2v[0], max_sequence_length=64, resolution=32, frames=9)


@pytest.fixture(scope="module")
def frames(tiny_cvx_i2v):
    return [(tiny_cvx_i2v[0] / "first_frames" / f"frame_{i}.png").read_bytes() for i in range(2)]


@pytest.fixture
def posterior_mode(monkeypatch):
    """The pipeline reading the source's posterior at its mode, as pixrl does."""
    import diffusers.pipelines.cogvideo.pipeline_cogvideox_image2video as mod

    monkeypatch.setattr(mod, "retrieve_latents", lambda out, generator=None: out.latent_dist.mode())


def _pipeline(family, frames, cfg, seeds, negative=None):
    """The pipeline given each source as pixrl crops it to the clip's aspect (it would stretch it)."""
    out = [family.pipe(image=source_pixels(family, frames[i], torch.float32)[0], prompt=[PROMPTS[i]],
                       negative_prompt=negative, guidance_scale=cfg, num_inference_steps=5, generator=gens([s]),
                       output_type="latent", height=family.height, width=family.width, num_frames=9,
                       max_sequence_length=64).frames
           for i, s in enumerate(seeds)]
    return torch.cat(out)


def test_registered_and_found_from_its_layout(tiny_cvx_i2v, family):
    assert get_family("cogvideox_i2v") is CogVideoXI2VFamily and CogVideoXI2VFamily.needs_images
    assert family_of_directory(tiny_cvx_i2v[0]) == "cogvideox_i2v"
    assert family.latent_shape() == (4, 4, 8, 8)  # 9 frames → 3 latent frames, padded to the 2-frame patch


def test_first_frame_condition_is_the_pipelines(family, frames, posterior_mode):
    cond = family.encode_prompts(PROMPTS, frames)
    pixels = family.pipe.video_processor.preprocess(Image.open(io.BytesIO(frames[0])).convert("RGB"), height=32, width=32)
    _, want = family.pipe.prepare_latents(pixels, 1, 4, 13, 32, 32, torch.float32, "cpu", gens([0]))
    assert cond.condition.shape == (2, 4, 4, 8, 8) and torch.allclose(cond.condition[:1], want, atol=1e-6)
    assert cond.condition[:, 1:].abs().sum() == 0 and cond.condition[:, 0].abs().sum() > 0


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (6.0, None), (6.0, "blurry, static")])
def test_ode_sampling_equals_the_image_to_video_pipeline(family, frames, posterior_mode, cfg, negative):
    cond = family.encode_prompts(PROMPTS, frames)
    neg = family.encode_negative(negative or "").expand(2) if cfg > 1 else None
    ref = _pipeline(family, frames, cfg, [3, 4], negative)
    traj = sample(family, cond, neg, gens([3, 4]), SamplerRecipe(5, 0.0, guidance_scale=cfg, train_steps=()))
    other = sample(family, family.encode_prompts(PROMPTS, frames[::-1]), neg, gens([3, 4]),
                   SamplerRecipe(5, 0.0, guidance_scale=cfg, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 4, 8, 8)
    assert (traj.final - ref).abs().max().item() <= 1e-5
    assert (other.final - traj.final).abs().max().item() > 1e-4  # the first frame reaches the clip


@pytest.mark.parametrize("sde_type,window", [("ddim", None), ("sde", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, frames, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=1.0 if sde_type == "ddim" else 0.7, sde_type=sde_type,
                           guidance_scale=6.0, sde_steps=window, train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2),
                               recipe)


def test_refusals_name_the_fix(family, tmp_path):
    assert_needs_its_source_images(family, PROMPTS, 999.0)


def test_a_learned_positions_checkpoint_runs_at_its_own_size(family, frames, posterior_mode, tmp_path):
    """CogVideoX-5B-I2V-shaped (learned positions for one 32×48 size, no ofs): refused at another
    size naming its own, and at its own (its default) the ODE equals the pipeline's."""
    from diffusers import CogVideoXImageToVideoPipeline, CogVideoXTransformer3DModel

    learned = CogVideoXTransformer3DModel.from_config({**family.transformer.config, "patch_size_t": None,
                                                       "ofs_embed_dim": None, "use_rotary_positional_embeddings": True,
                                                       "use_learned_positional_embeddings": True, "sample_width": 12})
    CogVideoXImageToVideoPipeline(**{**family.pipe.components, "transformer": learned}).save_pretrained(str(tmp_path / "5b"))
    with pytest.raises(ModelLoadError, match="model.resolution=32: .*learned positional embeddings for 32×48 clips "
                                             "only; set model.height=32 model.width=48"):
        CogVideoXI2VFamily.load(tmp_path / "5b", max_sequence_length=64, resolution=32, frames=9)
    native = CogVideoXI2VFamily.load(tmp_path / "5b", max_sequence_length=64, frames=9)
    assert (native.height, native.width) == (32, 48) and native.latent_shape() == (3, 4, 8, 12)
    ref = _pipeline(native, frames, 6.0, [3, 4])
    traj = sample(native, native.encode_prompts(PROMPTS, frames), native.encode_negative("").expand(2), gens([3, 4]),
                  SamplerRecipe(5, 0.0, guidance_scale=6.0, train_steps=()))
    assert traj.final.shape == ref.shape and (traj.final - ref).abs().max().item() <= 1e-5


def test_two_rl_iterations_through_the_unchanged_flow(tiny_cvx_i2v, tmp_path, prefect_harness):
    out, t = two_iterations(tiny_cvx_i2v, tmp_path, "cvx-i2v", "full", "sampling.guidance_scale=6.0")
    folder = tiny_cvx_i2v[0] / "first_frames"
    files = {json.loads(ln)["prompt"]: (folder / json.loads(ln)["image"]).read_bytes()
             for ln in (folder / "prompts.jsonl").read_text().splitlines()}
    assert all(img == files[p] for p, img in zip(t["prompt"].to_pylist(), t["source_image"].to_pylist()))
    assert decode_media(t["image"][0].as_py()).shape == (9, 32, 32, 3)
    rep = CliRunner().invoke(app, ["replay", "cvx-i2v", "--iteration", "1", "--workdir", str(tmp_path)])
    assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output


def test_the_presets():
    from pixrl.config.loader import load_config

    cfg = load_config("cogvideox15_i2v_video", ["model.path=/x", "dataset.path=/x.jsonl"])
    assert (cfg.model.family, cfg.model.resolution, cfg.model.frames) == ("cogvideox_i2v", 768, 81)
    assert cfg.dataset.name == "edits" and cfg.sampling.guidance_scale == 6.0
