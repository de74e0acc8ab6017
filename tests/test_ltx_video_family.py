"""LTX-Video text-to-video on a tiny random checkpoint written by `pixrl tiny ltx_video` in the
diffusers layout (a 0.9.1-shaped VAE: timestep-conditioned decoder that injects noise): the T5
encoding with its mask, the pipeline's dynamic-shift σ grid stretched to its terminal, ODE latents
equal to LTXPipeline's with and without CFG, decoded clips equal to its frames given the same
randomness, decode a function of the latents alone, replayed log-probs equal the stored ones,
the refusals, and two RL iterations (LoRA and full) through the unchanged flow."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.artifacts.media import decode_media
from pixrl.cli import app
from pixrl.models.base import ModelLoadError
from pixrl.models.ltx_video import LTXVideoFamily, latent_seed
from pixrl.models.registry import family_of_directory, get_family

PROMPTS = ["a red circle", "two blue squares in the sky"]
DECODE = {"decode_timestep": 0.03, "decode_noise_scale": 0.025}


@pytest.fixture(scope="module")
def tiny_ltx(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-ltx-video"
    return out, LTXVideoFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_ltx):
    return LTXVideoFamily.load(tiny_ltx[0], max_sequence_length=32, resolution=64, frames=9, **DECODE)


def _pipeline(family, cfg: float, seeds, output_type: str, negative: str | None = None, frame_rate: float = 25.0,
              global_seed: int = 0):
    """The pipeline one prompt a call (its VAE's injected noise is one draw per call), the global
    generator seeded first (the VAE reads it); latents unpacked to [B, C, F, H, W]."""
    out = []
    for p, s in zip(PROMPTS, seeds):
        torch.manual_seed(global_seed)
        res = family.pipe(prompt=[p], negative_prompt=negative, num_inference_steps=6, guidance_scale=cfg,
                          generator=gens([s]), output_type=output_type, height=family.height,
                          width=family.width, num_frames=9,
                          max_sequence_length=32, frame_rate=frame_rate, **DECODE).frames
        _, f, h, w = family.latent_shape()
        out.append(family.pipe._unpack_latents(res, f, h, w) if output_type == "latent" else res)
    return torch.cat(out) if output_type == "latent" else np.concatenate(out)


def test_registered_and_found_from_its_layout(tiny_ltx, family):
    assert get_family("ltx_video") is LTXVideoFamily and LTXVideoFamily.video
    assert family_of_directory(tiny_ltx[0]) == "ltx_video"
    assert family.latent_shape() == (8, 3, 4, 4)  # 9 frames → (9−1)/4 + 1; 64 px / 16
    names = [n for n, _ in family.transformer.named_modules()]
    assert all(any(n.endswith(t) for n in names) for t in LTXVideoFamily.lora_targets)
    d = family.describe()
    assert d["frames"] == 9 and d["shift_terminal"] == 0.1 and d["decode_noise_scale"] == 0.025


def test_encoding_is_the_pipelines_with_its_mask(family):
    cond = family.encode_prompts(PROMPTS)
    ref, mask, _, _ = family.pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=32,
                                                device="cpu")
    assert torch.equal(cond.prompt_embeds, ref) and torch.equal(cond.mask, mask)
    assert cond.prompt_embeds.shape[1] == 32 and cond.mask[0].sum() < cond.mask[1].sum()


def test_schedule_is_the_pipelines_dynamic_shift_to_its_terminal(family):
    from copy import deepcopy

    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    sigmas, timesteps = family.schedule(6)
    c = family.scheduler.config
    mu = calculate_shift(3 * 4 * 4, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sched = deepcopy(family.pipe.scheduler)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / 6, 6), mu=mu)
    assert torch.equal(timesteps, sched.timesteps.float()) and torch.equal(sigmas, sched.sigmas.float())
    assert sigmas[-1] == 0 and abs(float(sigmas[-2]) - 0.1) < 1e-6  # stretched to shift_terminal, then 0


@pytest.mark.parametrize("cfg,negative,rate", [(1.0, None, 25.0), (3.0, None, 25.0),
                                               (3.0, "worst quality, blurry, jittery", 24.0)])
def test_ode_sampling_equals_the_pipeline(tiny_ltx, family, cfg, negative, rate):
    fam = family if rate == 25.0 else LTXVideoFamily.load(tiny_ltx[0], max_sequence_length=32, resolution=64,
                                                          frames=9, frame_rate=rate, **DECODE)
    ref = _pipeline(fam, cfg, [3, 4], "latent", negative, frame_rate=rate)
    neg = fam.encode_negative(negative or "").expand(2) if cfg > 1 else None
    traj = sample(fam, fam.encode_prompts(PROMPTS), neg, gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 8, 3, 4, 4)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_non_square_ode_equals_the_pipeline(tiny_ltx):
    """The packed tokens and the dynamic shift of a 64×96 clip, as the pipeline's."""
    fam = wide(LTXVideoFamily, tiny_ltx[0], 64, 96, max_sequence_length=32, frames=9, **DECODE)
    ref = _pipeline(fam, 3.0, [3, 4], "latent")
    traj = sample(fam, fam.encode_prompts(PROMPTS), fam.encode_negative("").expand(2), gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=3.0, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 8, 3, 4, 6)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_frame_rate_reaches_the_rotary_time_axis(tiny_ltx, family):
    other = LTXVideoFamily.load(tiny_ltx[0], max_sequence_length=32, resolution=64, frames=9, frame_rate=8.0,
                                **DECODE)
    x, t, cond = torch.randn(1, 8, 3, 4, 4), torch.tensor([500.0]), family.encode_prompts(PROMPTS[:1])
    assert (family.velocity(x, t, cond) - other.velocity(x, t, cond)).abs().max() > 1e-4


def test_decoded_clips_equal_the_pipeline_given_its_randomness(family):
    """The pipeline draws the decode noise from each prompt's generator after its initial noise,
    and the VAE's injected noise from the global generator; given those, the clips are its frames."""
    ref = _pipeline(family, 3.0, [5, 6], "np", global_seed=17)
    traj = sample(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), gens([5, 6]),
                  SamplerRecipe(6, 0.0, guidance_scale=3.0, train_steps=()))
    clips = []
    for z, g in zip(traj.final, gens([5, 6])):
        torch.randn((1, 8, 3, 4, 4), generator=g)  # the initial noise the pipeline drew first
        clips.append(family.decode_clip(z[None], torch.randn((1, 8, 3, 4, 4), generator=g), 17))
    clips = np.concatenate(clips)
    assert clips.shape == (2, 9, 64, 64, 3) and clips.dtype == np.uint8
    assert np.abs(clips.astype(int) - (np.asarray(ref) * 255).round().astype(int)).max() <= 1
    # the randomness matters: another global seed decodes otherwise
    other = family.decode_clip(traj.final[:1], torch.zeros(1, 8, 3, 4, 4), 18)
    assert np.abs(other.astype(int) - clips[:1].astype(int)).max() > 1


def test_decode_is_a_function_of_each_clips_latents(family):
    z = torch.randn(3, 8, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    alone = np.concatenate([family.decode(z[i:i + 1]) for i in range(3)])
    torch.manual_seed(123)  # the global generator's state does not reach it
    together = family.decode(z)
    assert np.array_equal(alone, together) and np.array_equal(family.decode(z[[2, 0]]), together[[2, 0]])
    assert latent_seed(z[0]) != latent_seed(z[1]) and latent_seed(z[0]) == latent_seed(z[0].clone())


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=3.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_refusals_name_the_fix(tiny_ltx, tmp_path):
    path = tiny_ltx[0]
    with pytest.raises(ModelLoadError, match="model.frames=8.*4k\\+1 frames"):
        LTXVideoFamily.load(path, max_sequence_length=32, resolution=64, frames=8)
    with pytest.raises(ModelLoadError, match="model.resolution=40.*multiple of 16"):
        LTXVideoFamily.load(path, max_sequence_length=32, resolution=40, frames=9)
    with pytest.raises(ModelLoadError, match="decode_noise_scale=1.5"):
        LTXVideoFamily.load(path, max_sequence_length=32, resolution=64, frames=9, decode_noise_scale=1.5)
    from diffusers import AutoencoderKLLTXVideo, LTXPipeline

    fam = LTXVideoFamily.load(path, max_sequence_length=32, resolution=64, frames=9)
    plain = AutoencoderKLLTXVideo.from_config({**fam.vae.config, "timestep_conditioning": False})
    LTXPipeline(**{**fam.pipe.components, "vae": plain}).save_pretrained(str(tmp_path / "v090"))
    with pytest.raises(ModelLoadError, match="no timestep conditioning.*unset both"):
        LTXVideoFamily.load(tmp_path / "v090", max_sequence_length=32, resolution=64, frames=9, decode_timestep=0.03)
    ok = LTXVideoFamily.load(tmp_path / "v090", max_sequence_length=32, resolution=64, frames=9)
    assert ok.decode(torch.zeros(1, 8, 3, 4, 4)).shape == (1, 9, 64, 64, 3)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_rl_iterations_through_the_unchanged_flow(tiny_ltx, tmp_path, prefect_harness, mode):
    """Full fine-tuning then replays its iteration bit for bit: clips decoded again with the
    randomness their latents seed equal the stored ones."""
    out, t = two_iterations(tiny_ltx, tmp_path, f"ltx-{mode}", mode, "sampling.guidance_scale=3.0",
                            "sampling.negative_prompt='worst quality, blurry'")
    assert decode_media(t["image"][0].as_py()).shape == (9, 64, 64, 3)
    assert t["final_latent"].type.shape == [8, 3, 4, 4]
    if mode == "full":
        rep = CliRunner().invoke(app, ["replay", f"ltx-{mode}", "--iteration", "1", "--workdir", str(tmp_path)])
        assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output


def test_the_presets():
    from pixrl.config.loader import load_config

    cfg = load_config("ltx_video_video", ["model.path=/x"])
    m = cfg.model
    assert (m.family, m.size(), m.frames, m.max_sequence_length) == ("ltx_video", (512, 704), 65, 128)
    assert (m.decode_timestep, m.decode_noise_scale, cfg.sampling.guidance_scale) == (0.03, 0.025, 3.0)
    assert cfg.sampling.negative_prompt.startswith("worst quality") and cfg.algorithm.lora.enabled
