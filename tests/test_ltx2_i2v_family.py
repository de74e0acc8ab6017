"""LTX-2 image-to-audio+video on a tiny random checkpoint written by `pixrl tiny ltx2_i2v` (the
LTX2Pipeline layout): the first frame's tokens are LTX2ImageToVideoPipeline's encoding of the
source (re-compressed at the checkpoint's H.264 CRF, its posterior mode normalised and packed),
ODE latents of both streams equal the pipeline's under its guidance terms, the first frame reaches
the clip and its soundtrack, the held frame's part of each transition carries no parameter, a
stochastic last step still ends on the condition, replayed log-probs equal the stored ones, and
two RL iterations through the unchanged flow (rows keep their frames and soundtracks)."""

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import two_iterations
from family_checks import assert_needs_its_source_images, assert_replay_is_on_policy, assert_rows_keep_their_frames_and_replay, gens
from pixrl.algorithms.sampling import SamplerRecipe, initial_noise, sample
from pixrl.artifacts.media import decode_media
from pixrl.models.ltx2_i2v import LTX2I2VFamily
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.source_images import source_pixels

PROMPTS = ["the red circle drifts to the right", "the camera zooms in"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-ltx2-i2v"
    return out, LTX2I2VFamily.write_tiny(out, seed=0)


def _load(path, **kw):
    return LTX2I2VFamily.load(path, max_sequence_length=32, resolution=64, frames=9, **{"stg_blocks": [1], **kw})


@pytest.fixture(scope="module")
def family(tiny):
    return _load(tiny[0])


@pytest.fixture(scope="module")
def frames(tiny):
    return [(tiny[0] / "first_frames" / f"frame_{i}.png").read_bytes() for i in range(2)]


def _i2v_pipeline(fam):
    from diffusers import LTX2ImageToVideoPipeline

    pipe = LTX2ImageToVideoPipeline(**fam.pipe.components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_registered_and_selected_by_name(tiny, family):
    assert get_family("ltx2_i2v") is LTX2I2VFamily and LTX2I2VFamily.needs_images
    assert family_of_directory(tiny[0]) == "ltx2"  # the released layout: text-to-video by default
    assert family.frame_tokens == 16 and family.image_crf == 33  # a Gemma-3 checkpoint: the pipeline's CRF
    assert _load(tiny[0], text_towers=False).image_crf == 33  # a trainer rank reads it from the checkpoint


def test_first_frame_tokens_are_the_pipelines_encoding_of_the_recompressed_source(family, frames):
    from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf

    pipe = _i2v_pipeline(family)
    cond = family.encode_prompts(PROMPTS, frames)
    for i in range(2):  # the pipeline's __call__ on the picture: CRF, its video processor, `prepare_latents`
        picture = source_pixels(family, frames[i], torch.float32)[0]
        crf = resolve_default_image_crf(pipe.text_encoder)
        pixels = pipe.video_processor.preprocess(Image.fromarray(apply_image_conditioning_crf(np.asarray(picture), crf)),
                                                 height=64, width=64)
        lat, mask = pipe.prepare_latents(pixels, 1, 8, 64, 64, 9, generator=gens([i])[0], dtype=torch.float32)
        held = mask[0] == 1
        assert int(held.sum()) == family.frame_tokens and bool(held[:family.frame_tokens].all())
        assert (cond.condition[i] - lat[0, held]).abs().max().item() <= 1e-6
    plain = _load(family.path, image_crf=0).encode_prompts(PROMPTS[:1], frames[:1])
    assert (plain.condition - cond.condition[:1]).abs().max().item() > 1e-4  # the re-compression is applied


def _pipeline(fam, cond, x, frames, cfg, negative=None, **terms):
    """LTX2ImageToVideoPipeline from the joint start `x` with the condition in its first frame's
    tokens (what its `prepare_latents` builds from the source) — both streams un-normalised, the
    video unpacked, as it takes given latents."""
    pipe = _i2v_pipeline(fam)
    xv, xa = fam.split(x)
    start = fam.video_latents(torch.cat([cond.condition, xv[:, fam.frame_tokens:], xa], dim=1))
    vae, avae = fam.vae, fam.pipe.audio_vae
    xv = pipe._denormalize_latents(start, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    pictures = [source_pixels(fam, f, torch.float32)[0] for f in frames]
    return pipe(image=pictures[0], prompt=PROMPTS, negative_prompt=negative, height=64, width=64, num_frames=9,
                num_inference_steps=6, guidance_scale=cfg,
                audio_guidance_scale=terms.pop("audio_guidance_scale", 7.0 if cfg > 1 else 1.0), latents=xv,
                audio_latents=xa * avae.latents_std + avae.latents_mean, max_sequence_length=32,
                frame_rate=fam.frame_rate, output_type="latent", spatio_temporal_guidance_blocks=[1], **terms)


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (3.0, "worst quality, blurry")])
def test_ode_sampling_of_both_streams_equals_the_pipeline(family, frames, cfg, negative):
    cond = family.encode_prompts(PROMPTS, frames)
    neg = family.encode_negative(negative or "").expand(2) if cfg > 1 else None
    recipe = SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=())
    traj = sample(family, cond, neg, gens([3, 4]), recipe)
    ref = _pipeline(family, cond, initial_noise(gens([3, 4]), family.latent_shape()), frames, cfg, negative)
    video = family.video_latents(traj.final)
    ref_video = family.pipe._normalize_latents(ref.frames, family.vae.latents_mean, family.vae.latents_std)
    avae = family.pipe.audio_vae
    length, _, mel = family.audio_shape
    audio = family.pipe._unpack_audio_latents(family.pipe._denormalize_audio_latents(
        family.split(traj.final)[1], avae.latents_mean, avae.latents_std), length, num_mel_bins=mel)
    assert video.shape == ref_video.shape == (2, 8, 3, 4, 4) and audio.shape == ref.audio.shape
    assert (video - ref_video).abs().max().item() <= 1e-5
    assert (audio - ref.audio).abs().max().item() <= 1e-5
    other = sample(family, family.encode_prompts(PROMPTS, frames[::-1]), neg, gens([3, 4]), recipe)
    n = family.frame_tokens
    assert (other.final[:, n:family.video_tokens] - traj.final[:, n:family.video_tokens]).abs().max().item() > 1e-4
    assert (other.final[:, family.video_tokens:] - traj.final[:, family.video_tokens:]).abs().max().item() > 1e-5


def test_the_held_frames_transition_carries_no_parameter_and_ends_on_the_condition(family, frames):
    cond, neg = family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2)
    n = family.frame_tokens
    x = torch.randn((2, *family.latent_shape()), generator=torch.Generator().manual_seed(1))
    t = torch.full((2,), 500.0)
    v = family.velocity(x, t, cond, 3.0, neg)
    assert torch.allclose(v[:, :n], (x[:, :n] - cond.condition) / 0.5, atol=1e-5)
    with torch.no_grad():
        for p in family.transformer.parameters():
            p.add_(0.01)
        try:
            moved = family.velocity(x, t, cond, 3.0, neg)
        finally:
            for p in family.transformer.parameters():
                p.sub_(0.01)
    assert torch.equal(moved[:, :n], v[:, :n]) and not torch.allclose(moved[:, n:], v[:, n:])
    traj = sample(family, cond, neg, gens([5, 6]), SamplerRecipe(steps=4, noise_level=0.7, guidance_scale=3.0,
                                                                 train_steps=(0, 1, 2, 3)))
    assert (traj.next_latents[:, -1, :n] - cond.condition).abs().max().item() > 1e-3
    assert torch.equal(traj.final[:, :n], cond.condition) and torch.equal(traj.final[:, n:], traj.next_latents[:, -1, n:])


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_every_guidance_term(family, frames, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=3.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2),
                               recipe)


def test_refusals_name_the_fix(family):
    assert_needs_its_source_images(family, PROMPTS, 900.0)


def test_two_rl_iterations_through_the_unchanged_flow(tiny, tmp_path, prefect_harness):
    out, t = two_iterations(tiny, tmp_path, "ltx2-i2v", "lora", "sampling.guidance_scale=3.0")
    assert decode_media(t["image"][0].as_py()).shape == (9, 64, 64, 3) and t["soundtrack"].null_count == 0
    assert_rows_keep_their_frames_and_replay(tiny[0] / "first_frames" / "prompts.jsonl", t, "ltx2-i2v", tmp_path)


def test_the_presets():
    from pixrl.config.loader import load_config

    cfg = load_config("ltx2_i2v_video", ["model.path=/x", "dataset.path=/x.jsonl"])
    assert (cfg.model.family, cfg.model.size(), cfg.model.frames) == ("ltx2_i2v", (512, 768), 49)
    assert cfg.dataset.name == "edits" and cfg.algorithm.lora.enabled
