"""HunyuanVideo-1.5 text-to-video on a tiny random checkpoint written by `pixrl tiny hunyuan_video15`
in the diffusers layout: prompt encoding (Qwen2.5-VL under the system message, the pipeline's
fixed crop landing on the prompt; ByT5 for quoted text), the pipeline's σ grid, ODE sampling equal
to HunyuanVideo15Pipeline's with and without its CFG guider, decoded clips equal, replayed
log-probs equal to the stored ones, the refusals, and two RL iterations through the unchanged flow."""

import numpy as np
import pytest
import torch

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.artifacts.media import decode_media
from pixrl.models.base import ModelLoadError
from pixrl.models.hunyuan_video15 import CROP, HunyuanVideo15Family
from pixrl.models.registry import family_of_directory, get_family

PROMPTS = ["a red circle", "two blue squares in the sky"]


@pytest.fixture(scope="module")
def tiny_hv(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-hunyuan-video15"
    return out, HunyuanVideo15Family.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_hv):
    return HunyuanVideo15Family.load(tiny_hv[0], max_sequence_length=64, resolution=64, frames=5)


def _pipeline(family, cfg: float, seeds, output_type: str, negative: str | None = None):
    """The pipeline at CFG scale `cfg` (its guider's), one prompt a call (its VAE decodes one clip at a time)."""
    from diffusers import ClassifierFreeGuidance

    saved, family.pipe.guider = family.pipe.guider, ClassifierFreeGuidance(guidance_scale=cfg)
    try:
        out = [family.pipe(prompt=[p], negative_prompt=negative, num_inference_steps=6, generator=gens([s]), output_type=output_type,
                           height=family.height, width=family.width, num_frames=5).frames for p, s in zip(PROMPTS, seeds)]
    finally:
        family.pipe.guider = saved
    return torch.cat(out) if output_type == "latent" else np.concatenate(out)


def test_registered_and_found_from_its_layout(tiny_hv, family):
    assert get_family("hunyuan_video15") is HunyuanVideo15Family and HunyuanVideo15Family.video
    assert family_of_directory(tiny_hv[0]) == "hunyuan_video15"
    assert family.latent_shape() == (4, 2, 4, 4)  # 5 frames → (5−1)/4 + 1; 64 px / 16
    assert family.pipe.prompt_template_encode_start_idx == CROP
    names = [n for n, _ in family.transformer.named_modules()]
    assert all(any(n.endswith(t) for n in names) for t in HunyuanVideo15Family.lora_targets)


def test_encoding_is_the_pipelines_and_keeps_the_prompt(family):
    cond = family.encode_prompts(PROMPTS)
    ref = family.pipe.encode_prompt(list(PROMPTS), device="cpu", batch_size=2)
    got = (cond.prompt_embeds, cond.mask, cond.glyph_embeds, cond.glyph_mask)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

    tok = family.pipe.tokenizer  # the crop leaves exactly the prompt's own tokens first
    ids = tok.apply_chat_template(format_text_input([PROMPTS[1]], family.pipe.system_message)[0], tokenize=True,
                                  add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[CROP:CROP + 6] == tok(PROMPTS[1]).input_ids[:6]
    assert cond.mask[0].sum() < cond.mask[1].sum()  # "two blue squares in the sky" is longer
    assert cond.glyph_mask.sum() == 0  # nothing quoted: no glyphs
    quoted = family.encode_prompts(['a sign that says "hello"'])
    assert quoted.glyph_mask.sum() > 0 and quoted.glyph_embeds.abs().sum() > 0


def test_schedule_is_the_pipelines(family):
    from copy import deepcopy

    sigmas, timesteps = family.schedule(6)
    sched = deepcopy(family.pipe.scheduler)
    sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, 7)[:-1])
    assert torch.equal(timesteps, sched.timesteps.float()) and torch.equal(sigmas, sched.sigmas.float())
    assert sigmas[-1] == 0 and family.scheduler.config.shift == 7.0


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (6.0, None), (6.0, "blurry, static")])
def test_ode_sampling_equals_the_pipeline(family, cfg, negative):
    ref = _pipeline(family, cfg, [3, 4], "latent", negative)
    neg = family.encode_negative(negative or "").expand(2) if cfg > 1 else None
    traj = sample(family, family.encode_prompts(PROMPTS), neg, gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 2, 4, 4)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_non_square_ode_equals_the_pipeline(tiny_hv):
    fam = wide(HunyuanVideo15Family, tiny_hv[0], 64, 96, max_sequence_length=64, frames=5)
    ref = _pipeline(fam, 6.0, [3, 4], "latent")
    traj = sample(fam, fam.encode_prompts(PROMPTS), fam.encode_negative("").expand(2), gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=6.0, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 2, 4, 6)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_decoded_clips_equal_the_pipeline_frames(family):
    ref = _pipeline(family, 6.0, [5, 6], "np")
    traj = sample(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), gens([5, 6]),
                  SamplerRecipe(6, 0.0, guidance_scale=6.0, train_steps=()))
    clips = family.decode(traj.final)
    assert clips.shape == (2, 5, 64, 64, 3) and clips.dtype == np.uint8
    assert np.abs(clips.astype(int) - (np.asarray(ref) * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored_with_cfg(family, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=6.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_refusals_name_the_fix(tiny_hv, family, tmp_path):
    with pytest.raises(ModelLoadError, match="model.frames=4.*4k\\+1 frames"):
        HunyuanVideo15Family.load(tiny_hv[0], max_sequence_length=64, resolution=64, frames=4)
    from diffusers import HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel

    distilled = HunyuanVideo15Transformer3DModel.from_config({**family.transformer.config, "use_meanflow": True})
    HunyuanVideo15Pipeline(**{**family.pipe.components, "transformer": distilled}).save_pretrained(str(tmp_path / "mf"))
    with pytest.raises(ModelLoadError, match="step-distilled HunyuanVideo-1.5"):
        HunyuanVideo15Family.load(tmp_path / "mf", max_sequence_length=64, resolution=64, frames=5)


def test_two_rl_iterations_through_the_unchanged_flow(tiny_hv, tmp_path, prefect_harness):
    out, t = two_iterations(tiny_hv, tmp_path, "hv15", "lora", "sampling.guidance_scale=6.0")
    assert decode_media(t["image"][0].as_py()).shape == (5, 64, 64, 3)
    assert t["final_latent"].type.shape == [4, 2, 4, 4]
