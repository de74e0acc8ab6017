"""Cosmos-Predict2.5 on a tiny random checkpoint written by `pixrl tiny cosmos25`: the prompt
states equal the pipeline's (every layer normalised and concatenated), the σ grid is the shipped
UniPC's, ODE latents equal Cosmos2_5_PredictBasePipeline's on the flow-matching Euler scheduler —
Text2World with and without CFG (its w = pixrl's s − 1) and Image2World given the same first frame —
decoded clips equal, the condition frame's part of a transition parameter-free, replayed
log-probs equal the stored ones, and RL iterations through the unchanged flow (Text2World with
LoRA and full fine-tuning, Image2World from a prompt set of first frames)."""

import numpy as np
import pytest
import torch

from conftest import two_iterations
from family_checks import (PassingGuardrail, assert_held_frame_is_parameter_free, assert_replay_is_on_policy,
                           assert_rows_keep_their_frames_and_replay, euler, gens, wide)
from pixrl.algorithms.sampling import SamplerRecipe, initial_noise, sample
from pixrl.artifacts.media import decode_media
from pixrl.models.cosmos25 import Cosmos25Family
from pixrl.models.registry import family_of_directory, get_family
from pixrl.models.source_images import png_bytes, source_pixels, write_prompt_images

PROMPTS = ["a red circle", "two blue squares in the sky"]


@pytest.fixture(scope="module")
def tiny_c25(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-cosmos25"
    return out, Cosmos25Family.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_c25):
    return Cosmos25Family.load(tiny_c25[0], max_sequence_length=64, resolution=32, frames=5)


@pytest.fixture(scope="module")
def frames():
    rng = np.random.default_rng(3)
    return [png_bytes(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)) for _ in PROMPTS]


def _pipeline(family, cfg: float, seeds, negative: str = "", output_type: str = "latent", frames=None):
    """The pipeline on Euler (the family's `euler` context), one call; Image2World one prompt and
    frame a call through its video input (its image input needs torchvision), given our noise."""
    family.pipe.safety_checker = PassingGuardrail()
    common = dict(negative_prompt=negative, guidance_scale=cfg - 1.0, num_inference_steps=6, output_type=output_type,
                  height=family.height, width=family.width, num_frames=family.frames, max_sequence_length=64)
    try:
        if frames is None:
            return family.pipe(prompt=list(PROMPTS), generator=gens(seeds), **{**common, "negative_prompt": [negative] * 2}).frames
        out = []
        for i, seed in enumerate(seeds):
            _, pixels = source_pixels(family, frames[i], torch.float32)
            out.append(family.pipe(prompt=PROMPTS[i], video=pixels.unsqueeze(2), num_latent_conditional_frames=1,
                                   latents=initial_noise(gens([seed]), family.latent_shape()), **common).frames)
        return torch.cat(out)
    finally:
        family.pipe.safety_checker = None


def _ode(family, cfg: float, seeds, negative: str = "", frames=None):
    neg = family.encode_negative(negative).expand(2) if cfg > 1 else None
    return sample(family, family.encode_prompts(PROMPTS, frames), neg, gens(seeds),
                  SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))


def test_registered_and_found_from_its_layout(tiny_c25, family):
    assert get_family("cosmos25") is Cosmos25Family and family_of_directory(tiny_c25[0]) == "cosmos25"
    assert family.latent_shape() == (4, 3, 8, 8) and family.pipe.safety_checker is None
    names = [n for n, _ in family.transformer.named_modules()]
    assert all(any(n.endswith(t) for n in names) for t in Cosmos25Family.lora_targets)


def test_prompt_states_are_every_layer_normalised_and_concatenated(family):
    cond = family.encode_prompts(PROMPTS)
    ref = family.pipe._get_prompt_embeds(list(PROMPTS), max_sequence_length=64, device="cpu")
    assert torch.equal(cond.prompt_embeds, ref) and cond.prompt_embeds.shape == (2, 64, 2 * 32)
    per_layer = cond.prompt_embeds[..., :32]
    assert torch.allclose(per_layer.mean(-1), torch.zeros(2, 64), atol=1e-5) and cond.condition is None


def test_schedule_is_the_shipped_unipc_grid_with_times_sigma(family):
    from copy import deepcopy

    sigmas, times = family.schedule(6)
    sched = deepcopy(family.pipe.scheduler)
    sched.set_timesteps(6)
    assert torch.equal(sigmas, sched.sigmas.float()) and torch.equal(times, sigmas[:-1]) and sigmas[-1] == 0


def test_a_compressed_tail_is_respaced_on_the_shipped_solvers_shift(family):
    """MixGRPO-Flash re-spaces the steps after its window in unshifted time and shifts them back:
    with the shift of the grid (UniPC's `flow_shift`, which FlowMatchEuler calls `shift`), not 1."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from pixrl.algorithms.sampling import grid_shift

    assert grid_shift(family.scheduler.config) == 5.0 == family.scheduler.config.flow_shift
    assert grid_shift(FlowMatchEulerDiscreteScheduler(shift=3.0).config) == 3.0
    assert grid_shift(FlowMatchEulerDiscreteScheduler().config) == 1.0


@pytest.mark.parametrize("cfg,negative", [(1.0, ""), (8.0, ""), (4.0, "blurry, low quality")])
def test_text2world_ode_equals_the_pipeline_on_euler(family, cfg, negative):
    with euler(family):
        ref = _pipeline(family, cfg, [3, 4], negative)
        traj = _ode(family, cfg, [3, 4], negative)
    assert traj.final.shape == ref.shape == (2, 4, 3, 8, 8)
    assert (traj.final - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("cfg", [1.0, 8.0])
def test_image2world_ode_equals_the_pipeline_given_the_same_first_frame(family, frames, cfg):
    with euler(family):
        ref = _pipeline(family, cfg, [3, 4], frames=frames)
        traj = _ode(family, cfg, [3, 4], frames=frames)
    cond = family.encode_prompts(PROMPTS, frames)
    assert traj.final.shape == ref.shape == (2, 4, 3, 8, 8)
    assert (traj.final - ref).abs().max().item() <= 1e-5
    assert (traj.final[:, :, :1] - cond.condition).abs().max().item() <= 1e-5  # the clip starts on its frame


def test_non_square_ode_and_decoded_clips_equal_the_pipeline(tiny_c25):
    fam = wide(Cosmos25Family, tiny_c25[0], 32, 48, max_sequence_length=64, frames=5)
    with euler(fam):
        ref = _pipeline(fam, 8.0, [5, 6])
        clips = _pipeline(fam, 8.0, [5, 6], output_type="np")
        traj = _ode(fam, 8.0, [5, 6])
    assert traj.final.shape == ref.shape == (2, 4, 3, 8, 12)
    assert (traj.final - ref).abs().max().item() <= 1e-5
    got = fam.decode(traj.final)
    assert got.shape == (2, 5, 32, 48, 3) and got.dtype == np.uint8
    assert np.abs(got.astype(int) - (np.asarray(clips) * 255).round().astype(int)).max() <= 1


def test_the_condition_frames_transition_carries_no_parameter(family, frames):
    cond, neg = family.encode_prompts(PROMPTS, frames), family.encode_negative("").expand(2)
    assert_held_frame_is_parameter_free(family, cond, neg, 8.0, 0.5, per_thousand=False)


@pytest.mark.parametrize("sde_type,window,image", [("sde", None, False), ("cps", None, False), ("sde", (1, 2), True)])
def test_replayed_log_probs_equal_stored_with_cfg(family, frames, sde_type, window, image):
    recipe = SamplerRecipe(steps=4, noise_level=0.7, sde_type=sde_type, guidance_scale=8.0, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS, frames if image else None),
                               family.encode_negative("").expand(2), recipe)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_text2world_iterations_through_the_unchanged_flow(tiny_c25, tmp_path, prefect_harness, mode):
    out, t = two_iterations(tiny_c25, tmp_path, f"c25_{mode}", mode, "sampling.guidance_scale=8.0")
    assert t["final_latent"].type.shape == [4, 3, 8, 8] and "source_image" not in t.column_names
    assert decode_media(t["image"][0].as_py()).shape == (5, 32, 32, 3)


def test_image2world_iterations_keep_each_rows_frame_and_replay(tiny_c25, tmp_path, prefect_harness):
    from pixrl.models.wan_i2v import FIRST_FRAME_PROMPTS

    prompts = write_prompt_images(tmp_path / "first_frames", FIRST_FRAME_PROMPTS, 0, stem="frame")
    out, t = two_iterations(tiny_c25, tmp_path, "c25_i2w", "lora", "sampling.guidance_scale=8.0", "dataset.name=edits",
                            f"dataset.path={prompts}", "dataset.heldout_path=null", "dataset.categories=null")
    assert_rows_keep_their_frames_and_replay(prompts, t, "c25_i2w", tmp_path)


def test_the_presets():
    from diffusers.pipelines.cosmos.pipeline_cosmos2_5_predict import DEFAULT_NEGATIVE_PROMPT

    from pixrl.config.loader import load_config

    cfg = load_config("cosmos25_video", ["model.path=/x", "dataset.path=/x.txt", "reward.options.videoalign.path=/v",
                                         "reward.options.videoalign.base=/b"])
    assert (cfg.model.family, cfg.model.size(), cfg.model.frames) == ("cosmos25", (480, 832), 33)
    assert cfg.sampling.guidance_scale == 8.0 and cfg.sampling.negative_prompt == DEFAULT_NEGATIVE_PROMPT
    assert cfg.sampling.eval_steps == 36 and cfg.algorithm.lora.rank == 64
