"""Wan image-to-video on tiny random checkpoints written by `pixrl tiny wan_i2v` (Wan2.1-I2V:
CLIP image states; `--two-experts`: Wan2.2-I2V-A14B) in the diffusers layout: the first-frame
condition and CLIP states equal WanImageToVideoPipeline's, ODE sampling equals the pipeline's with
and without CFG, the first frame reaches the velocity, replayed log-probs equal the stored ones,
a trainer rank without towers replays with the rollout's encodings, the refusals, and two RL
iterations through the unchanged flow (rows keep their first frames; `pixrl replay` equal;
`pixrl generate --image` animates a frame)."""

import io
import json

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from conftest import two_iterations
from family_checks import assert_needs_its_source_images, assert_replay_is_on_policy, euler, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.artifacts.media import decode_media
from pixrl.cli import app
from pixrl.engines.prompt_cache import PromptCache
from pixrl.models.base import ModelLoadError
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.source_images import condition_keys, source_pixels
from pixrl.models.wan_i2v import WanI2VFamily

PROMPTS = ["the red circle drifts to the right", "the camera zooms in"]


@pytest.fixture(scope="module")
def tiny_i2v(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-wan-i2v"
    return out, WanI2VFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_i2v):
    return WanI2VFamily.load(tiny_i2v[0], max_sequence_length=64, resolution=32, frames=5)


@pytest.fixture(scope="module")
def frames(tiny_i2v):
    return [(tiny_i2v[0] / "first_frames" / f"frame_{i}.png").read_bytes() for i in range(2)]


def _pipeline(family, cond, negative, frames, cfg, seeds, **kw):
    """WanImageToVideoPipeline, one prompt at a time (it takes one image per call), encoding its
    negative prompt itself."""
    out = [family.pipe(image=source_pixels(family, frames[i], torch.float32)[0], prompt_embeds=cond.prompt_embeds[i:i + 1],
                       negative_prompt=negative, guidance_scale=cfg,
                       num_inference_steps=6, generator=gens([s]), output_type="latent",
                       height=family.height, width=family.width, num_frames=5, max_sequence_length=64, **kw).frames for i, s in enumerate(seeds)]
    return torch.cat(out)


def test_registered_and_found_from_its_layout(tiny_i2v, family):
    assert get_family("wan_i2v") is WanI2VFamily and WanI2VFamily.video and WanI2VFamily.needs_images
    assert family_of_directory(tiny_i2v[0]) == "wan_i2v"
    assert family.latent_shape() == (4, 3, 8, 8) and family.transformer.config.in_channels == 10
    assert set(family.text_towers()) == {"text_encoder", "image_encoder"}
    names = [n for n, _ in family.transformer.named_modules()]
    assert all(any(n.endswith(t) for n in names) for t in WanI2VFamily.lora_targets)


def test_first_frame_condition_and_clip_states_are_the_pipelines(family, frames):
    cond = family.encode_prompts(PROMPTS, frames)
    for i, im in enumerate(frames):
        picture = Image.open(io.BytesIO(im)).convert("RGB")
        pixels = family.pipe.video_processor.preprocess(picture, height=32, width=32).to(torch.float32)
        _, want = family.pipe.prepare_latents(pixels, 1, 4, 32, 32, 5, torch.float32, "cpu", gens([0]))
        assert torch.equal(cond.condition[i:i + 1], want)
        assert torch.equal(cond.image_embeds[i:i + 1], family.pipe.encode_image(picture, "cpu"))
    assert cond.condition.shape == (2, 2 + 4, 3, 8, 8) and cond.condition[:, :2, 0].eq(1).all()
    assert cond.condition[:, :2, 1:].eq(0).all()


def test_non_square_ode_equals_the_image_to_video_pipeline(tiny_i2v, frames):
    """A 32×48 clip, its first frame the source centre-cropped to that aspect (given so to the pipeline)."""
    fam = wide(WanI2VFamily, tiny_i2v[0], 32, 48, max_sequence_length=64, frames=5)
    cond, neg = fam.encode_prompts(PROMPTS, frames), fam.encode_negative("").expand(2)
    with euler(fam):
        ref = _pipeline(fam, cond, "", frames, 5.0, [3, 4])
        traj = sample(fam, cond, neg, gens([3, 4]), SamplerRecipe(6, 0.0, guidance_scale=5.0, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 3, 8, 12)
    assert (traj.final - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (5.0, ""), (5.0, "blurry, static")])
def test_ode_sampling_equals_the_image_to_video_pipeline(family, frames, cfg, negative):
    cond = family.encode_prompts(PROMPTS, frames)
    neg = family.encode_negative(negative).expand(2) if cfg > 1 else None
    with euler(family):
        ref = _pipeline(family, cond, negative, frames, cfg, [3, 4])
        traj = sample(family, cond, neg, gens([3, 4]), SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
        other = sample(family, family.encode_prompts(PROMPTS, frames[::-1]), neg, gens([3, 4]),
                       SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 3, 8, 8)
    assert (traj.final - ref).abs().max().item() <= 1e-5
    assert (other.final - traj.final).abs().max().item() > 1e-4  # the first frame reaches the velocity


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, frames, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=5.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2),
                               recipe)


def test_a_trainer_rank_without_towers_replays_with_the_rollouts_encodings(tiny_i2v, family, frames):
    bare = WanI2VFamily.load(tiny_i2v[0], max_sequence_length=64, resolution=32, frames=5, text_towers=False)
    assert bare.pipe.image_encoder is None and bare.pipe.text_encoder is None and not bare.text_towers()
    keys = condition_keys(PROMPTS, frames)
    exported = PromptCache(family).encodings([keys], negative="", images=frames)
    held = PromptCache.holding(bare, exported)
    (cond, pos), neg = held.encode(keys), held.negative("")
    want, want_pos = PromptCache(family).encode(keys, frames)
    x = torch.randn((2, *family.latent_shape()), generator=torch.Generator().manual_seed(0))
    t = family.schedule(4)[1][1].repeat(2)
    with torch.no_grad():
        v_bare = bare.velocity(x, t, cond.select([pos[k] for k in keys]), 5.0, neg.expand(2))
        v_full = family.velocity(x, t, want.select([want_pos[k] for k in keys]), 5.0,
                                 family.encode_negative("").expand(2))
    assert torch.equal(v_bare, v_full)


def test_refusals_name_the_fix(tiny_i2v, family, tiny_wan, tmp_path):
    assert_needs_its_source_images(family, PROMPTS, 900.0)
    with pytest.raises(ModelLoadError, match="holds a WanPipeline, not a WanImageToVideoPipeline"):
        WanI2VFamily.load(tiny_wan[0], max_sequence_length=64, resolution=32, frames=5)
    family.pipe.register_to_config(expand_timesteps=True)  # Wan2.2-TI2V-5B's image-to-video
    try:
        family.pipe.save_pretrained(str(tmp_path / "ti2v"))
    finally:
        family.pipe.register_to_config(expand_timesteps=False)
    with pytest.raises(ModelLoadError, match="Wan2.2-TI2V-5B's image-to-video.*model.family=wan"):
        WanI2VFamily.load(tmp_path / "ti2v", max_sequence_length=64, resolution=32, frames=5)
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    flf2v = WanTransformer3DModel.from_config({**family.transformer.config, "pos_embed_seq_len": 2 * 17})
    WanImageToVideoPipeline(**{**family.pipe.components, "transformer": flf2v}).save_pretrained(str(tmp_path / "flf"))
    with pytest.raises(ModelLoadError, match="first-last-frame checkpoint"):
        WanI2VFamily.load(tmp_path / "flf", max_sequence_length=64, resolution=32, frames=5)


@pytest.fixture(scope="module")
def tiny_i2v_a14b(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-wan22-i2v"
    return out, WanI2VFamily.write_tiny(out, seed=3, two_experts=True)


@pytest.mark.parametrize("expert", ["high", "low"])
def test_two_expert_image_to_video_equals_the_pipeline(tiny_i2v_a14b, frames, expert):
    """Wan2.2-I2V-A14B: no CLIP image encoder, two experts switched at t ≥ 0.9·T, each its CFG scale."""
    fam = WanI2VFamily.load(tiny_i2v_a14b[0], max_sequence_length=64, resolution=32, frames=5, expert=expert,
                            guidance_scale_2=3.0)
    assert fam.boundary == 900.0 and not fam.reads_clip and fam.pipe.image_encoder is None
    cond, neg = fam.encode_prompts(PROMPTS, frames), fam.encode_negative("").expand(2)
    assert cond.image_embeds is None
    with euler(fam):
        ref = _pipeline(fam, cond, "", frames, 4.0, [7, 8], guidance_scale_2=3.0)
        _, timesteps = fam.schedule(6)
        traj = sample(fam, cond, neg, gens([7, 8]), SamplerRecipe(6, 0.0, guidance_scale=4.0, train_steps=()))
    assert (timesteps >= 900).any() and (timesteps < 900).any()  # both experts denoise
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_two_rl_iterations_through_the_unchanged_flow(tiny_i2v, tmp_path, prefect_harness):
    """LoRA; rows keep their first frames and lossless clips; `pixrl replay` of iteration 1 equals the
    recorded checkpoint; `pixrl generate --image` animates a frame with the trained policy."""
    out, t = two_iterations(tiny_i2v, tmp_path, "i2v", "lora", "sampling.guidance_scale=5.0")
    folder = tiny_i2v[0] / "first_frames"
    files = {json.loads(ln)["prompt"]: (folder / json.loads(ln)["image"]).read_bytes()
             for ln in (folder / "prompts.jsonl").read_text().splitlines()}
    assert t["source_image"].null_count == 0
    assert all(img == files[p] for p, img in zip(t["prompt"].to_pylist(), t["source_image"].to_pylist()))
    assert decode_media(t["image"][0].as_py()).shape == (5, 32, 32, 3)
    rep = CliRunner().invoke(app, ["replay", "i2v", "--iteration", "1", "--workdir", str(tmp_path)])
    assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output
    res = CliRunner().invoke(app, ["generate", "--run", "i2v", "--workdir", str(tmp_path), "--prompt", PROMPTS[0],
                                   "--image", str(folder / "frame_0.png"), "--out", str(tmp_path / "gen"),
                                   "--steps", "2"])
    assert res.exit_code == 0, res.output
    (clip,) = sorted((tmp_path / "gen").glob("*.png"))  # an animated PNG, with its JSON sidecar
    assert decode_media(clip.read_bytes()).shape == (5, 32, 32, 3)
