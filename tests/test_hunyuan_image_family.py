"""HunyuanImage-2.1 on a tiny random checkpoint written by `pixrl tiny hunyuan_image` in the diffusers
layout: prompt encoding (Qwen2.5-VL under the description template, ByT5 for quoted text), the
pipeline's σ grid, ODE sampling equal to HunyuanImagePipeline's under its adaptive projected
guidance — whose momentum buffer the rollout carries and stores — decoded images equal, replayed
log-probs equal to the stored ones, the refusals, and RL iterations through the unchanged flow."""

import numpy as np
import pytest
import torch

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens
from pixrl.algorithms.guidance_memory import GuidanceMemory
from pixrl.algorithms.sampling import SamplerRecipe, replay_step, sample
from pixrl.models.base import ModelLoadError
from pixrl.models.hunyuan_image import HunyuanImageFamily, apg_guided, guider_settings
from pixrl.models.registry import family_of_directory, get_family

PROMPTS = ["a red circle", "two blue squares in the sky"]
MIXED = ['a sign that says "hello"', "a red circle"]  # the first takes the OCR guider, the second the plain one


@pytest.fixture(scope="module")
def tiny_hy(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-hunyuan-image"
    return out, HunyuanImageFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_hy):
    return HunyuanImageFamily.load(tiny_hy[0], max_sequence_length=64, resolution=32)


def _pipeline(family, prompts, cfg: float, seeds, output_type: str, steps: int = 6, negative: str | None = None):
    """The pipeline with both guiders at CFG scale `cfg`, one prompt a call (it picks one guider per batch)."""
    saved = family.pipe.guider, family.pipe.ocr_guider
    family.pipe.guider, family.pipe.ocr_guider = (g.new(guidance_scale=cfg) for g in saved)
    try:
        out = [family.pipe(prompt=[p], negative_prompt=negative, num_inference_steps=steps, generator=gens([s]),
                           output_type=output_type, height=family.height, width=family.width).images
               for p, s in zip(prompts, seeds)]
    finally:
        family.pipe.guider, family.pipe.ocr_guider = saved
    return torch.cat(out) if output_type == "latent" else np.concatenate(out)


def _sample(family, prompts, cfg: float, seeds, steps: int = 6, negative: str = ""):
    neg = family.encode_negative(negative).expand(len(prompts)) if cfg > 1 else None
    return sample(family, family.encode_prompts(prompts), neg, gens(seeds),
                  SamplerRecipe(steps, 0.0, guidance_scale=cfg, train_steps=()))


def test_registered_and_found_from_its_layout(tiny_hy, family):
    assert get_family("hunyuan_image") is HunyuanImageFamily
    assert family_of_directory(tiny_hy[0]) == "hunyuan_image"
    assert family.latent_shape() == (4, 4, 4) and family.guidance_memory
    names = [n for n, _ in family.transformer.named_modules()]
    assert all(any(n.endswith(t) for n in names) for t in HunyuanImageFamily.lora_targets)


def test_encoding_is_the_pipelines(family):
    cond = family.encode_prompts(MIXED)
    ref = family.pipe.encode_prompt(list(MIXED), device="cpu", batch_size=2)
    got = (cond.prompt_embeds, cond.mask, cond.glyph_embeds, cond.glyph_mask)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    tok = family.pipe.tokenizer  # the template's 34 tokens dropped: the prompt's own tokens come first
    ids = tok(family.pipe.prompt_template_encode.format(MIXED[1])).input_ids
    assert ids[34:34 + 3] == tok(MIXED[1]).input_ids[:3]
    assert cond.glyph_mask[0].sum() > 0 and cond.glyph_mask[1].sum() == 0  # only the quoted prompt has glyphs


@pytest.mark.parametrize("cfg,prompts,negative", [(1.0, PROMPTS, None), (3.5, PROMPTS, None), (3.5, MIXED, None),
                                                  (5.0, MIXED, "blurry")])
def test_ode_sampling_equals_the_pipeline(family, cfg, prompts, negative):
    """Six steps: CFG for steps 0–2, APG after (the tiny guiders start it after step 2, OCR after 1)."""
    ref = _pipeline(family, prompts, cfg, [3, 4], "latent", negative=negative)
    traj = _sample(family, prompts, cfg, [3, 4], negative=negative or "")
    assert traj.final.shape == ref.shape == (2, 4, 4, 4)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_apg_momentum_matters(family):
    """Without the carried buffer (each step's c − u alone) or with plain CFG throughout, the
    latents leave the pipeline's: the memory is what makes the parity above."""
    ref = _pipeline(family, PROMPTS, 3.5, [3, 4], "latent")
    saved = dict(family.guiders)
    try:
        family.guiders = {k: {**g, "adaptive_projected_guidance_momentum": None} for k, g in saved.items()}
        no_memory = _sample(family, PROMPTS, 3.5, [3, 4]).final
        family.guiders = {k: {**g, "adaptive_projected_guidance_start_step": 99} for k, g in saved.items()}
        plain_cfg = _sample(family, PROMPTS, 3.5, [3, 4]).final
    finally:
        family.guiders = saved
    assert (no_memory - ref).abs().max().item() > 1e-3 and (plain_cfg - ref).abs().max().item() > 1e-3


def test_apg_step_is_the_guiders(family):
    """`apg_guided` against AdaptiveProjectedMixGuidance itself, step by step, on random predictions
    (a norm threshold that bites, η ≠ 0, a guidance rescale)."""
    from diffusers import AdaptiveProjectedMixGuidance

    guider = AdaptiveProjectedMixGuidance(guidance_scale=4.0, adaptive_projected_guidance_scale=7.0,
                                          adaptive_projected_guidance_rescale=0.5, eta=0.3, guidance_rescale=0.2,
                                          adaptive_projected_guidance_start_step=1)
    g = guider_settings("test", "guider", guider)
    gen, prev = torch.Generator().manual_seed(0), None
    for k in range(4):
        c, u = torch.randn(2, 4, 3, 3, generator=gen), torch.randn(2, 4, 3, 3, generator=gen)
        guider.set_state(step=k, num_inference_steps=4, timestep=torch.tensor(1.0))
        guider.prepare_inputs({"x": (c, u)})
        want = guider.forward(c, u).pred
        got, prev = apg_guided(c, u, 4.0, g, k, prev)
        assert torch.equal(got, want), k
        assert torch.equal(prev, guider.momentum_buffer.running_average)


def test_decoded_images_equal_the_pipelines(family):
    ref = _pipeline(family, PROMPTS, 3.5, [5, 6], "np")
    images = family.decode(_sample(family, PROMPTS, 3.5, [5, 6]).final)
    assert images.shape == (2, 32, 32, 3) and images.dtype == np.uint8
    assert np.abs(images.astype(int) - (np.asarray(ref) * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (3, 4))])
def test_replayed_log_probs_equal_stored_under_apg(family, sde_type, window):
    """Stored steps on both sides of APG's start, the window past it (its memory from the ODE steps
    before it): replay given each transition's stored memory reproduces the log-probs bit for bit."""
    recipe = SamplerRecipe(steps=6, noise_level=0.7, sde_type=sde_type, guidance_scale=3.5, sde_steps=window,
                           train_steps=window or (0, 2, 4))
    assert_replay_is_on_policy(family, family.encode_prompts(MIXED), family.encode_negative("").expand(2), recipe)


def test_the_stored_memory_is_the_momentum_before_each_step(family):
    cond, neg = family.encode_prompts(PROMPTS), family.encode_negative("").expand(2)
    recipe = SamplerRecipe(steps=6, noise_level=0.7, guidance_scale=3.5, train_steps=(0, 4))
    traj = sample(family, cond, neg, gens([0, 1]), recipe)
    assert traj.memory.shape == traj.latents.shape and torch.equal(traj.memory[:, 0], torch.zeros_like(traj.latents[:, 0]))
    assert traj.memory[:, 1].abs().sum() > 0
    replay = lambda m: replay_step(family, traj.latents[:, 1], traj.next_latents[:, 1], 4, traj.sigmas,  # noqa: E731
                                   traj.timesteps, cond, neg, recipe, m).log_prob
    assert torch.equal(replay(traj.memory[:, 1]), traj.log_probs[:, 1])
    assert not torch.equal(replay(torch.zeros_like(traj.memory[:, 1])), traj.log_probs[:, 1])
    with pytest.raises(ValueError, match="no guidance_memory column"):
        replay(None)
    plain = SamplerRecipe(steps=6, noise_level=0.7, guidance_scale=1.0, train_steps=(0, 4))
    assert sample(family, cond, None, gens([0, 1]), plain).memory is None  # no CFG: nothing to carry
    mem = GuidanceMemory()
    family.velocity(traj.latents[:, 0], traj.timesteps[:1], cond, 3.5, neg, memory=mem, step=0)
    assert mem.value is not None and mem.value.shape == traj.latents[:, 0].shape


def test_refusals_name_the_fix(tiny_hy, family, tmp_path):
    from diffusers import AdaptiveProjectedMixGuidance, HunyuanImagePipeline, HunyuanImageTransformer2DModel

    distilled = HunyuanImageTransformer2DModel.from_config({**family.transformer.config, "guidance_embeds": True,
                                                            "use_meanflow": True})
    HunyuanImagePipeline(**{**family.pipe.components, "transformer": distilled}).save_pretrained(str(tmp_path / "d"))
    with pytest.raises(ModelLoadError, match="distilled HunyuanImage-2.1"):
        HunyuanImageFamily.load(tmp_path / "d", max_sequence_length=64, resolution=32)
    late = AdaptiveProjectedMixGuidance(start=0.2)
    HunyuanImagePipeline(**{**family.pipe.components, "guider": late}).save_pretrained(str(tmp_path / "g"))
    with pytest.raises(ModelLoadError, match="guider applies guidance only from 0.2"):
        HunyuanImageFamily.load(tmp_path / "g", max_sequence_length=64, resolution=32)
    with pytest.raises(ModelLoadError, match="model.max_sequence_length=1001"):
        HunyuanImageFamily.load(tiny_hy[0], max_sequence_length=1001, resolution=32)


def test_two_rl_iterations_store_and_replay_the_memory(tiny_hy, tmp_path, prefect_harness):
    """LoRA Flow-GRPO under APG through the flow: the rows keep each stored step's memory, and
    `pixrl replay` of an iteration recomputes its update from them exactly."""
    out, t = two_iterations(tiny_hy, tmp_path, "hyimg", "lora", "sampling.guidance_scale=3.5", "sampling.steps=6")
    assert t["guidance_memory"].type.shape == t["latents"].type.shape
    memory = np.stack(t["guidance_memory"].to_numpy(zero_copy_only=False))
    assert memory.shape[0] == 16 and np.abs(memory).sum() > 0
    import json

    from typer.testing import CliRunner

    from pixrl.cli import app

    rep = CliRunner().invoke(app, ["replay", "hyimg", "--iteration", "1", "--workdir", str(tmp_path)])
    assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output


def test_full_fine_tuning_without_guidance_stores_no_memory(tiny_hy, tmp_path, prefect_harness):
    _, t = two_iterations(tiny_hy, tmp_path, "hyimg_full", "full", "sampling.guidance_scale=1.0")
    assert "guidance_memory" not in t.schema.names  # no CFG: the guiders keep nothing, the table has the usual layout


def test_the_preset_samples_as_the_pipeline_does():
    from pixrl.config.loader import load_config

    cfg = load_config("hunyuan_image21_pickscore", ["model.path=/x"])
    assert (cfg.model.family, cfg.model.resolution, cfg.model.max_sequence_length) == ("hunyuan_image", 2048, 1000)
    assert cfg.sampling.guidance_scale == 3.5 and cfg.sampling.negative_prompt == "" and cfg.sampling.eval_steps == 50
    assert cfg.algorithm.lora.rank == 64 and cfg.reward.weights == {"pickscore": 1.0}
