"""CogVideoX text-to-video on a tiny random checkpoint written by `pixrl tiny cogvideox` in the
diffusers layout (5B-style rotary positions; 2B's sinusoidal ones and 1.5's temporal patch as
variants): the T5 encoding, the DDIM grid of its SNR-shifted, zero-terminal-SNR table as flow
noise levels from σ = 1, ODE latents equal to CogVideoXPipeline's with and without CFG, decoded
clips equal to its frames, replayed log-probs equal the stored ones (DDPO's DDIM-η too), and two
RL iterations (LoRA, and DDPO full fine-tuning with `pixrl replay` exact) through the unchanged flow."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_overrides, two_iterations
from family_checks import assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.artifacts.media import decode_media
from pixrl.cli import app
from pixrl.models.base import ModelLoadError
from pixrl.models.cogvideox import CogVideoXFamily
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.sd15 import sigma_of_alpha_bar

PROMPTS = ["a red circle", "two blue squares in the sky"]


def _tiny(tmp_path_factory, name: str, **transformer):
    out = tmp_path_factory.mktemp("ckpt") / name
    return out, CogVideoXFamily.write_tiny(out, seed=0, **transformer)


@pytest.fixture(scope="module")
def tiny_cvx(tmp_path_factory):
    return _tiny(tmp_path_factory, "tiny-cogvideox")


@pytest.fixture(scope="module")
def family(tiny_cvx):
    return CogVideoXFamily.load(tiny_cvx[0], max_sequence_length=64, resolution=32, frames=9)


def _pipeline(family, cfg: float, seeds, output_type: str, negative: str | None = None, frames: int = 9,
              dynamic: bool = False):
    """The pipeline one prompt a call (its VAE decodes a clip at a time in pixrl too)."""
    out = [family.pipe(prompt=[p], negative_prompt=negative, num_inference_steps=5, guidance_scale=cfg,
                       use_dynamic_cfg=dynamic,
                       generator=gens([s]), output_type=output_type, height=family.height, width=family.width,
                       num_frames=frames,
                       max_sequence_length=64).frames for p, s in zip(PROMPTS, seeds)]
    return torch.cat(out) if output_type == "latent" else np.concatenate(out)


def _ode(family, cfg: float, seeds, negative: str | None = None, steps: int = 5):
    neg = family.encode_negative(negative or "").expand(2) if cfg > 1 else None
    return sample(family, family.encode_prompts(PROMPTS), neg, gens(seeds),
                  SamplerRecipe(steps, 0.0, guidance_scale=cfg, train_steps=())).final


def test_registered_and_found_from_its_layout(tiny_cvx, family):
    assert get_family("cogvideox") is CogVideoXFamily and CogVideoXFamily.video and family.variance_preserving
    assert family_of_directory(tiny_cvx[0]) == "cogvideox"
    assert family.latent_shape() == (3, 4, 8, 8)  # frame-major: 9 frames → 3; 32 px / 4
    names = [n for n, _ in family.transformer.named_modules()]
    assert all(any(n.endswith(t) for n in names) for t in CogVideoXFamily.lora_targets)
    d = family.describe()
    assert d["prediction_type"] == "v_prediction" and d["snr_shift_scale"] == 3.0 and d["zero_terminal_snr"]


def test_encoding_is_the_pipelines(family):
    cond = family.encode_prompts(PROMPTS)
    ref, _ = family.pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=64,
                                       device="cpu")
    assert torch.equal(cond.prompt_embeds, ref) and ref.shape[1] == 64


def test_schedule_is_the_shifted_zero_snr_ddim_grid(family):
    from copy import deepcopy

    sigmas, timesteps = family.schedule(5)
    sched = deepcopy(family.pipe.scheduler)
    sched.set_timesteps(5)
    assert torch.equal(timesteps, sched.timesteps.float()) and timesteps[0] == 999  # trailing
    ab = sched.alphas_cumprod.double()
    plain = torch.cumprod(1 - sched.betas.double(), 0)  # without the shift (and before the rescale)
    assert not torch.allclose(ab[500], plain[500])
    expect = sigma_of_alpha_bar(torch.cat([ab[sched.timesteps], torch.ones(1, dtype=torch.float64)])).float()
    assert torch.allclose(sigmas, expect, atol=1e-7) and sigmas[0] == 1 and sigmas[-1] == 0
    assert family.timesteps_at(torch.tensor([1.0]))[0] == 999  # σ = 1 (zero SNR) is the last timestep


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (6.0, None), (6.0, "blurry, low quality")])
def test_ode_sampling_equals_the_pipeline(family, cfg, negative):
    ref = _pipeline(family, cfg, [3, 4], "latent", negative)
    final = _ode(family, cfg, [3, 4], negative)
    assert final.shape == ref.shape == (2, 3, 4, 8, 8)
    assert (final - ref).abs().max().item() <= 1e-5


def test_dynamic_cfg_equals_the_pipelines_use_dynamic_cfg(tiny_cvx):
    """model.dynamic_cfg: each step's scale from its timestep as the pipeline computes it; the ODE
    equals CogVideoXPipeline's with use_dynamic_cfg=True, differs from constant CFG, and replays
    on policy; at a scale of 1 there is no CFG batch, schedule or not."""
    fam = CogVideoXFamily.load(tiny_cvx[0], max_sequence_length=64, resolution=32, frames=9, dynamic_cfg=True)
    assert fam.describe()["dynamic_cfg"] and fam.guidance_schedule(6.0, torch.tensor(999.0), 5) != 6.0
    ref = _pipeline(fam, 6.0, [3, 4], "latent", dynamic=True)
    final = _ode(fam, 6.0, [3, 4])
    assert (final - ref).abs().max().item() <= 1e-5
    plain = CogVideoXFamily.load(tiny_cvx[0], max_sequence_length=64, resolution=32, frames=9)
    assert (_ode(plain, 6.0, [3, 4]) - final).abs().max().item() > 1e-4
    assert torch.equal(_ode(fam, 1.0, [3, 4]), _ode(plain, 1.0, [3, 4]))
    neg = fam.encode_negative("").expand(2)
    assert_replay_is_on_policy(fam, fam.encode_prompts(PROMPTS), neg,
                               SamplerRecipe(5, 0.7, guidance_scale=6.0, sde_steps=(1, 2), train_steps=(1, 2)))
    from pixrl.config.loader import load_config
    from pixrl.stages.preflight import PreflightError, preflight

    cfg = load_config(None, tiny_overrides(tiny_cvx[0], tiny_cvx[0].parent / "wd", **tiny_cvx[1],
                                           **{"model.dynamic_cfg": "true", "sampling.guidance_scale": 1.0}))
    with pytest.raises(PreflightError, match="model.dynamic_cfg: sampling.guidance_scale=1 batches no"):
        preflight(cfg)


def test_non_square_ode_equals_the_pipeline(tiny_cvx):
    """The rotary table of a 32×48 clip, as the pipeline builds it."""
    fam = wide(CogVideoXFamily, tiny_cvx[0], 32, 48, max_sequence_length=64, frames=9)
    ref = _pipeline(fam, 6.0, [3, 4], "latent")
    final = _ode(fam, 6.0, [3, 4], None)
    assert final.shape == ref.shape == (2, 3, 4, 8, 12)
    assert (final - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("variant,shape", [("2b", (3, 4, 8, 8)), ("1.5", (4, 4, 8, 8))])
def test_2b_and_1_5_checkpoints_sample_as_their_pipeline(tmp_path_factory, variant, shape):
    """CogVideoX-2B: sinusoidal positions instead of rotary; 1.5: a 2-frame temporal patch, its
    latent frames padded in front to a multiple of 2 (3 → 4) and the padding dropped to decode."""
    extra = ({"use_rotary_positional_embeddings": False} if variant == "2b" else
             {"patch_size_t": 2, "use_rotary_positional_embeddings": True})
    path, _ = _tiny(tmp_path_factory, f"tiny-cogvideox-{variant}", **extra)
    fam = CogVideoXFamily.load(path, max_sequence_length=64, resolution=32, frames=9)
    assert fam.latent_shape() == shape
    ref = _pipeline(fam, 6.0, [3, 4], "latent")
    final = _ode(fam, 6.0, [3, 4])
    assert (final - ref).abs().max().item() <= 1e-5
    clips = fam.decode(final)
    assert clips.shape == (2, 9, 32, 32, 3)


def test_a_shipped_dpm_solver_is_stepped_as_ddim(tiny_cvx, tmp_path):
    """The 5B ships CogVideoXDPMScheduler: rollouts step the same table's DDIM grid, equal to the
    pipeline given CogVideoXDDIMScheduler."""
    import shutil

    from diffusers import CogVideoXDPMScheduler

    shipped = tmp_path / "dpm"
    shutil.copytree(tiny_cvx[0], shipped)
    fam = CogVideoXFamily.load(shipped, max_sequence_length=64, resolution=32, frames=9)
    CogVideoXDPMScheduler.from_config(fam.pipe.scheduler.config).save_pretrained(str(shipped / "scheduler"))
    index = json.loads((shipped / "model_index.json").read_text())
    index["scheduler"][1] = "CogVideoXDPMScheduler"
    (shipped / "model_index.json").write_text(json.dumps(index))
    dpm = CogVideoXFamily.load(shipped, max_sequence_length=64, resolution=32, frames=9)
    assert type(dpm.scheduler).__name__ == "CogVideoXDPMScheduler" and type(dpm.ddim).__name__ == "CogVideoXDDIMScheduler"
    final = _ode(dpm, 6.0, [3, 4])
    dpm.pipe.scheduler = fam.pipe.scheduler
    assert (final - _pipeline(dpm, 6.0, [3, 4], "latent")).abs().max().item() <= 1e-5


def test_decoded_clips_equal_the_pipeline_frames(family):
    ref = _pipeline(family, 6.0, [5, 6], "np")
    clips = family.decode(_ode(family, 6.0, [5, 6]))
    assert clips.shape == (2, 9, 32, 32, 3) and clips.dtype == np.uint8
    assert np.abs(clips.astype(int) - (np.asarray(ref) * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("sde_type,window", [("ddim", None), ("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=1.0 if sde_type == "ddim" else 0.7, sde_type=sde_type,
                           guidance_scale=6.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_refusals_name_the_fix(tiny_cvx):
    path = tiny_cvx[0]
    with pytest.raises(ModelLoadError, match="model.frames=8.*4k\\+1 frames"):
        CogVideoXFamily.load(path, max_sequence_length=64, resolution=32, frames=8)
    with pytest.raises(ModelLoadError, match="model.resolution=36.*multiple of 8"):
        CogVideoXFamily.load(path, max_sequence_length=64, resolution=36, frames=9)
    with pytest.raises(ModelLoadError, match="model.max_sequence_length=300.*1–226"):
        CogVideoXFamily.load(path, max_sequence_length=300, resolution=32, frames=9)


def test_two_rl_iterations_with_lora(tiny_cvx, tmp_path, prefect_harness):
    out, t = two_iterations(tiny_cvx, tmp_path, "cvx-lora", "lora", "sampling.guidance_scale=6.0")
    assert decode_media(t["image"][0].as_py()).shape == (9, 32, 32, 3)
    assert t["final_latent"].type.shape == [3, 4, 8, 8]


def test_ddpo_onto_the_last_step_is_refused_in_preflight(tiny_cvx, tmp_path):
    """Its table ends at ᾱ = 1 (σ = 0), where the DDIM-η step has no log-prob: refused before any work."""
    tiny = {k: v for k, v in tiny_cvx[1].items() if k != "model.path"}
    res = CliRunner().invoke(app, ["train", "--iterations", "1", "--run", "cvx-refused", "reward=jpeg_compressibility",
                                   "algorithm=ddpo", *tiny_overrides(tiny_cvx[0], tmp_path, **tiny),
                                   "sampling.sde_type=ddim", "sampling.noise_level=1.0", "sampling.window_size=null",
                                   "sampling.window_range=null", "sampling.timestep_fraction=1.0"])
    assert res.exit_code == 2 and "ends its grid at ᾱ = 1" in res.output and "timestep_fraction" in res.output
    assert not (tmp_path / "cvx-refused").exists() and not list(tmp_path.glob("**/*.lance"))


def test_two_ddpo_iterations_full_fine_tune_replay_exactly(tiny_cvx, tmp_path, prefect_harness):
    """DDPO's recipe: DDIM-η (η = 1) at every step; the last step lands on ᾱ = 1 (σ = 0), where
    DDIM-η has no noise, so the 4-step grid stores its first 3 (timestep_fraction 0.75)."""
    out, t = two_iterations(tiny_cvx, tmp_path, "cvx-ddpo", "full", "sampling.sde_type=ddim",
                            "sampling.noise_level=1.0", "sampling.window_size=null", "sampling.window_range=null",
                            "sampling.timestep_fraction=0.75", "sampling.guidance_scale=6.0", "algorithm.lora.enabled=false",
                            algorithm="ddpo")
    recipe = json.loads(t["recipe"][0].as_py())
    assert recipe["sde_type"] == "ddim" and recipe["train_steps"] == [0, 1, 2]
    assert t["timesteps"][0].as_py()[:2] == [999.0, 749.0]
    rep = CliRunner().invoke(app, ["replay", "cvx-ddpo", "--iteration", "1", "--workdir", str(tmp_path)])
    assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output


def test_the_presets():
    from pixrl.config.loader import load_config

    cfg = load_config("cogvideox_video", ["model.path=/x"])
    m = cfg.model
    assert (m.family, m.size(), m.frames, m.max_sequence_length) == ("cogvideox", (480, 720), 49, 226)
    assert cfg.sampling.guidance_scale == 6.0 and cfg.algorithm.lora.enabled
