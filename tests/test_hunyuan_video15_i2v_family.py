"""HunyuanVideo-1.5 image-to-video on a tiny random checkpoint written by `pixrl tiny
hunyuan_video15_i2v`: the first-frame condition, mask and SigLIP states equal
HunyuanVideo15ImageToVideoPipeline's, ODE sampling equals the pipeline's with and without its CFG
guider, the frame reaches the velocity, replayed log-probs equal the stored ones, a prompt without
a frame is refused, and two RL iterations through the unchanged flow keep each row's frame."""

import io
import json

import pytest
import torch
from PIL import Image

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.models.hunyuan_video15_i2v import HunyuanVideo15I2VFamily
from pixrl.models.registry import family_of_directory
from pixrl.models.source_images import SourceImageError, source_pixels

PROMPTS = ["the red circle drifts to the right", "the camera zooms in"]


@pytest.fixture(scope="module")
def tiny_hvi(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-hunyuan-video15-i2v"
    return out, HunyuanVideo15I2VFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_hvi):
    return HunyuanVideo15I2VFamily.load(tiny_hvi[0], max_sequence_length=64, resolution=64, frames=5)


@pytest.fixture(scope="module")
def frames(tiny_hvi):
    return [(tiny_hvi[0] / "first_frames" / f"frame_{i}.png").read_bytes() for i in range(2)]


def _pil(image: bytes):
    return Image.open(io.BytesIO(image)).convert("RGB")


def test_first_frame_condition_and_siglip_states_are_the_pipelines(tiny_hvi, family, frames):
    assert family_of_directory(tiny_hvi[0]) == "hunyuan_video15_i2v"
    assert set(family.text_towers()) == {"text_encoder", "text_encoder_2", "image_encoder"}
    cond = family.encode_prompts(PROMPTS, frames)
    x = torch.zeros(2, *family.latent_shape())
    hidden, image = family._inputs(x, cond)
    for i, im in enumerate(frames):
        want_cond, want_mask = family.pipe.prepare_cond_latents_and_mask(x[i:i + 1], _pil(im), 1, 64, 64, torch.float32,
                                                                         "cpu")
        assert torch.equal(hidden[i:i + 1, 4:8], want_cond) and torch.equal(hidden[i:i + 1, 8:], want_mask)
        assert torch.equal(image[i:i + 1], family.pipe.encode_image(_pil(im), 1, "cpu", torch.float32))


def test_non_square_ode_equals_the_image_to_video_pipeline(tiny_hvi, frames):
    """The pipeline sizes the clip from its image (the target-size bucket nearest its aspect):
    given each source cropped to 48×80, a bucket, it makes the 48×80 clip pixrl makes."""
    from diffusers import ClassifierFreeGuidance

    fam = wide(HunyuanVideo15I2VFamily, tiny_hvi[0], 48, 80, max_sequence_length=64, frames=5)
    fam.pipe.guider = ClassifierFreeGuidance(guidance_scale=1.0)
    ref = torch.cat([fam.pipe(image=source_pixels(fam, frames[i], torch.float32)[0], prompt=[PROMPTS[i]],
                              num_inference_steps=6, generator=gens([3 + i]), output_type="latent", num_frames=5).frames
                     for i in range(2)])
    traj = sample(fam, fam.encode_prompts(PROMPTS, frames), None, gens([3, 4]), SamplerRecipe(6, 0.0, train_steps=()))
    assert traj.final.shape == ref.shape and traj.final.shape[-2:] == (3, 5)
    assert (traj.final - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (6.0, None), (6.0, "blurry, static")])
def test_ode_sampling_equals_the_image_to_video_pipeline(family, frames, cfg, negative):
    from diffusers import ClassifierFreeGuidance

    saved, family.pipe.guider = family.pipe.guider, ClassifierFreeGuidance(guidance_scale=cfg)
    try:
        ref = torch.cat([family.pipe(image=_pil(frames[i]), prompt=[PROMPTS[i]], negative_prompt=negative,
                                     num_inference_steps=6,
                                     generator=gens([3 + i]), output_type="latent", num_frames=5).frames
                         for i in range(2)])
    finally:
        family.pipe.guider = saved
    neg = family.encode_negative(negative or "").expand(2) if cfg > 1 else None
    recipe = SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=())
    traj = sample(family, family.encode_prompts(PROMPTS, frames), neg, gens([3, 4]), recipe)
    other = sample(family, family.encode_prompts(PROMPTS, frames[::-1]), neg, gens([3, 4]), recipe)
    assert traj.final.shape == ref.shape and (traj.final - ref).abs().max().item() <= 1e-5
    assert (other.final - traj.final).abs().max().item() > 1e-4  # the first frame reaches the velocity


def test_replay_is_exact_and_a_prompt_without_a_frame_is_refused(family, frames):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, guidance_scale=6.0, sde_steps=(1, 2), train_steps=(1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2),
                               recipe)
    with pytest.raises(SourceImageError, match="every prompt needs a source image"):
        family.encode_prompts(PROMPTS, [frames[0], None])
    with pytest.raises(SourceImageError, match="encoded without source images"):
        family.velocity(torch.zeros(1, *family.latent_shape()), torch.tensor([900.0]), family.encode_prompts(PROMPTS[:1]))


def test_two_rl_iterations_keep_each_rows_first_frame(tiny_hvi, tmp_path, prefect_harness):
    out, t = two_iterations(tiny_hvi, tmp_path, "hvi", "lora", "sampling.guidance_scale=6.0")
    folder = tiny_hvi[0] / "first_frames"
    files = {json.loads(ln)["prompt"]: (folder / json.loads(ln)["image"]).read_bytes()
             for ln in (folder / "prompts.jsonl").read_text().splitlines()}
    assert t["source_image"].null_count == 0
    assert all(img == files[p] for p, img in zip(t["prompt"].to_pylist(), t["source_image"].to_pylist()))
