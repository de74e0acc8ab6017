"""HunyuanVideo (1.0) on a tiny random checkpoint written by `pixrl tiny hunyuan_video` in the
diffusers layout: prompt encoding (Llama under the video template, the pipeline's fixed crop of 95
landing on the prompt; CLIP pooled), the σ grid with the checkpoint's shift and with `model.shift`,
ODE sampling equal to HunyuanVideoPipeline's at embedded guidance 1 and 6, decoded clips equal,
replayed log-probs equal to the stored ones (SDE, CPS, window, Dance), the refusals, and RL
iterations through the unchanged flow with LoRA and with full fine-tuning."""

import numpy as np
import pytest
import torch

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, gens, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.artifacts.media import decode_media
from pixrl.models.base import ModelLoadError
from pixrl.models.hunyuan_video import CROP, HunyuanVideoFamily
from pixrl.models.registry import family_of_directory, get_family

PROMPTS = ["a red circle", "two blue squares in the sky"]


@pytest.fixture(scope="module")
def tiny_hv(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-hunyuan-video"
    return out, HunyuanVideoFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_hv):
    return HunyuanVideoFamily.load(tiny_hv[0], max_sequence_length=64, resolution=32, frames=5)


def _pipeline(family, guidance: float, seeds, output_type: str):
    """The pipeline at embedded guidance `guidance`, one prompt a call (its VAE decodes one clip at a time)."""
    out = [family.pipe(prompt=[p], num_inference_steps=6, generator=gens([s]), output_type=output_type,
                       height=family.height, width=family.width, num_frames=5, guidance_scale=guidance, max_sequence_length=64).frames
           for p, s in zip(PROMPTS, seeds)]
    return torch.cat(out) if output_type == "latent" else np.concatenate(out)


def test_registered_and_found_from_its_layout(tiny_hv, family):
    assert get_family("hunyuan_video") is HunyuanVideoFamily and HunyuanVideoFamily.video
    assert family_of_directory(tiny_hv[0]) == "hunyuan_video"
    assert family.latent_shape() == (4, 2, 4, 4)  # 5 frames → (5−1)/4 + 1; 32 px / 8
    assert type(family.pipe.tokenizer).__name__ == "LlamaTokenizer"  # LlamaTokenizerFast, as model_index.json says
    names = [n for n, _ in family.transformer.named_modules()]
    assert all(any(n.endswith(t) for n in names) for t in HunyuanVideoFamily.lora_targets)


def test_encoding_is_the_pipelines_and_keeps_the_prompt(family):
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    cond = family.encode_prompts(PROMPTS)
    embeds, pooled, mask = family.pipe.encode_prompt(list(PROMPTS), device="cpu", max_sequence_length=64)
    assert torch.equal(cond.prompt_embeds, embeds) and torch.equal(cond.mask, mask) and torch.equal(cond.pooled, pooled)
    assert cond.prompt_embeds.shape == (2, 64, 32) and cond.pooled.shape == (2, 32)
    tok = family.pipe.tokenizer  # the crop leaves exactly the prompt's own tokens first
    ids = tok(DEFAULT_PROMPT_TEMPLATE["template"].format(PROMPTS[1])).input_ids
    assert tok.convert_ids_to_tokens(ids[CROP:CROP + 3]) == ["t", "w", "o"] and ids[CROP + 3:CROP + 5] == \
        tok.convert_tokens_to_ids(["▁blue", "▁squares"])
    assert cond.mask.sum(1).tolist() == [4, 9]  # the prompt's tokens and <|eot_id|>; template and padding dropped


def test_schedule_is_the_pipelines_and_takes_model_shift(tiny_hv, family):
    from copy import deepcopy

    sigmas, timesteps = family.schedule(6)
    sched = deepcopy(family.pipe.scheduler)
    sched.set_timesteps(sigmas=np.linspace(1.0, 0.0, 7)[:-1])
    assert torch.equal(timesteps, sched.timesteps.float()) and torch.equal(sigmas, sched.sigmas.float())
    assert sigmas[-1] == 0 and family.describe()["shift"] == 7.0
    five = HunyuanVideoFamily.load(tiny_hv[0], max_sequence_length=64, resolution=32, frames=5, shift=5.0)
    s5, _ = five.schedule(6)
    u = torch.linspace(1, 0, 7, dtype=torch.float64)[:-1]
    assert torch.allclose(s5[:-1].double(), 5 * u / (1 + 4 * u), atol=1e-6)  # shift·t / (1 + (shift − 1)·t)
    assert five.describe()["shift"] == 5.0 and family.scheduler.config.shift == 7.0  # the checkpoint's unchanged


@pytest.mark.parametrize("guidance", [1.0, 6.0])
def test_ode_sampling_equals_the_pipeline(family, guidance):
    ref = _pipeline(family, guidance, [3, 4], "latent")
    traj = sample(family, family.encode_prompts(PROMPTS), None, gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=guidance, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 2, 4, 4)
    assert (traj.final - ref).abs().max().item() <= 1e-5
    if guidance > 1:  # the embedding is read: another scale moves the clip
        other = sample(family, family.encode_prompts(PROMPTS), None, gens([3, 4]),
                       SamplerRecipe(6, 0.0, guidance_scale=1.0, train_steps=()))
        assert (other.final - traj.final).abs().max() > 1e-4


def test_non_square_ode_equals_the_pipeline(tiny_hv):
    fam = wide(HunyuanVideoFamily, tiny_hv[0], 48, 32, max_sequence_length=64, frames=5)
    ref = _pipeline(fam, 6.0, [3, 4], "latent")
    traj = sample(fam, fam.encode_prompts(PROMPTS), None, gens([3, 4]),
                  SamplerRecipe(6, 0.0, guidance_scale=6.0, train_steps=()))
    assert traj.final.shape == ref.shape == (2, 4, 2, 6, 4)
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_decoded_clips_equal_the_pipeline_frames(family):
    ref = _pipeline(family, 6.0, [5, 6], "np")
    traj = sample(family, family.encode_prompts(PROMPTS), None, gens([5, 6]),
                  SamplerRecipe(6, 0.0, guidance_scale=6.0, train_steps=()))
    clips = family.decode(traj.final)
    assert clips.shape == (2, 5, 32, 32, 3) and clips.dtype == np.uint8
    assert np.abs(clips.astype(int) - (np.asarray(ref) * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2)), ("dance", None)])
def test_replayed_log_probs_equal_stored(family, sde_type, window):
    recipe = SamplerRecipe(steps=4, noise_level=0.25 if sde_type == "dance" else 0.7, sde_type=sde_type,
                           guidance_scale=6.0, sde_steps=window, train_steps=window or (0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), None, recipe)


def test_refusals_name_the_fix(tiny_hv, tmp_path):
    with pytest.raises(ModelLoadError, match="model.frames=4.*4k\\+1 frames"):
        HunyuanVideoFamily.load(tiny_hv[0], max_sequence_length=64, resolution=32, frames=4)
    with pytest.raises(ModelLoadError, match="model.resolution=24.*multiple of 16"):
        HunyuanVideoFamily.load(tiny_hv[0], max_sequence_length=64, resolution=24, frames=5)
    with pytest.raises(ModelLoadError, match="reads 1–256 prompt tokens"):
        HunyuanVideoFamily.load(tiny_hv[0], max_sequence_length=300, resolution=32, frames=5)
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline

    pipe = HunyuanVideoPipeline.from_pretrained(str(tiny_hv[0]))
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    pipe.save_pretrained(str(tmp_path / "dyn"))
    with pytest.raises(ModelLoadError, match="model.shift=5.0.*dynamic.*unset model.shift"):
        HunyuanVideoFamily.load(tmp_path / "dyn", max_sequence_length=64, resolution=32, frames=5, shift=5.0)


def test_model_shift_is_refused_by_a_family_without_it(tmp_path):
    from pixrl.config.loader import load_config
    from pixrl.stages.preflight import PreflightError, preflight

    cfg = load_config(None, ["model.shift=5", f"run.workdir={tmp_path}"])  # the miniature (sd3 family)
    with pytest.raises(PreflightError, match="model.shift=5.0: the sd3 family does not read it.*hunyuan_video"):
        preflight(cfg)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_rl_iterations_through_the_unchanged_flow(tiny_hv, tmp_path, prefect_harness, mode):
    if mode == "lora":  # Flow-GRPO with LoRA at embedded guidance 6
        out, t = two_iterations(tiny_hv, tmp_path, "hv", "lora", "sampling.guidance_scale=6.0")
    else:  # DanceGRPO, full fine-tuning, on DanceGRPO's shift 5
        out, t = two_iterations(tiny_hv, tmp_path, "hv-full", "full", "sampling.sde_type=dance", "sampling.noise_level=0.25",
                                "sampling.window_size=null", "sampling.window_range=null", "model.shift=5",
                                "sampling.guidance_scale=6.0", algorithm="dance_grpo")
        import json

        assert json.loads(t["recipe"][0].as_py())["shift"] == 5.0
    assert decode_media(t["image"][0].as_py()).shape == (5, 32, 32, 3)
    assert t["final_latent"].type.shape == [4, 2, 4, 4]


def test_an_export_samples_on_the_grid_it_was_trained_on(tiny_hv, tmp_path):
    """model.shift travels with an export: a whole pipeline's scheduler is the one sampled with
    (from_pretrained alone gives the trained grid), the manifest records it (pixrl reads it back),
    and an adapter's load line re-grids its base."""
    import json

    from diffusers import HunyuanVideoPipeline
    from typer.testing import CliRunner

    from pixrl.artifacts.checkpoints import save_checkpoint
    from pixrl.cli import app
    from pixrl.config.loader import load_config
    from pixrl.engines.policy import TrainablePolicy

    overrides = [f"{k}={v}" for k, v in tiny_hv[1].items()] + ["model.shift=5", f"run.workdir={tmp_path}"]
    for mode, flags in (("full", ["algorithm.lora.enabled=false"]),
                        ("lora", ["algorithm.lora.enabled=true", "algorithm.lora.rank=4", "algorithm.lora.alpha=8"])):
        cfg = load_config(None, overrides + flags)
        pol = TrainablePolicy(cfg)
        ckpt = tmp_path / f"ckpt-{mode}"
        save_checkpoint(ckpt, {k: v.detach() for k, v in pol.trainable_parameters().items()}, {}, {"iteration": 0},
                        cfg.model_dump(mode="json"))
        out = tmp_path / f"export-{mode}"
        res = CliRunner().invoke(app, ["export-model", "--checkpoint", str(ckpt), "--out", str(out)])
        assert res.exit_code == 0, res.output
        manifest = json.loads((out / "pixrl_export.json").read_text())
        assert manifest["model"]["shift"] == 5.0
        if mode == "full":
            assert HunyuanVideoPipeline.from_pretrained(str(out)).scheduler.config.shift == 5.0
            assert HunyuanVideoPipeline.from_pretrained(str(tiny_hv[0])).scheduler.config.shift == 7.0  # base kept
        else:
            assert "from_config(pipe.scheduler.config, shift=5.0)" in manifest["load"]
