"""The FLUX.1 family on a tiny random checkpoint written by `pixrl tiny flux1` in the diffusers
layout: loader errors, ODE parity with diffusers' FluxPipeline (embedded guidance, packed
latents, dynamic shift), decode parity, the on-policy ratio of replayed log-probs, LoRA targets,
and one RL iteration through the unchanged flow."""

import json

import lance
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import tiny_overrides
from family_checks import gens, wide
from pixrl.algorithms.losses import ppo_clip_loss
from pixrl.algorithms.sampling import SamplerRecipe, replay_step, sample
from pixrl.cli import app
from pixrl.models.base import ModelLoadError, uses_negative_prompt
from pixrl.models.flux import FluxFamily
from pixrl.models.registry import get_family, registered_families
from pixrl.models.taxonomy import PolicyStep, Regime

PROMPTS = ["a red circle", "two blue squares"]


@pytest.fixture(scope="module")
def family(tiny_flux):
    path, overrides = tiny_flux
    return FluxFamily.load(path, max_sequence_length=overrides["model.max_sequence_length"],
                           resolution=overrides["model.resolution"])


def _pipeline(family, guidance: float, seeds, output_type: str):
    return family.pipe(prompt=PROMPTS, num_inference_steps=6, guidance_scale=guidance, output_type=output_type,
                       generator=[torch.Generator().manual_seed(s) for s in seeds], height=family.height,
                       width=family.width, max_sequence_length=family.max_sequence_length).images


def test_registered_with_its_semantics_and_guidance():
    assert get_family("flux1") is FluxFamily and "flux1" in registered_families()
    assert FluxFamily.semantics.regime is Regime.full_sequence and FluxFamily.semantics.step is PolicyStep.denoise
    assert not uses_negative_prompt(FluxFamily, 3.5)  # distilled guidance: no negative-prompt batch
    assert uses_negative_prompt(get_family("sd3"), 3.5) and not uses_negative_prompt(get_family("sd3"), 1.0)


def test_layout_errors_name_the_fix(tmp_path, tiny_checkpoint, tiny_flux):
    with pytest.raises(ModelLoadError, match="model_index.json.*pixrl tiny flux1"):
        FluxFamily.load(tmp_path)
    with pytest.raises(ModelLoadError, match="StableDiffusion3Pipeline, not a FluxPipeline.*model.family"):
        FluxFamily.load(tiny_checkpoint)
    with pytest.raises(ModelLoadError, match="max_sequence_length=0"):
        FluxFamily.load(tiny_flux[0], max_sequence_length=0)
    with pytest.raises(ModelLoadError, match="resolution=30.*multiple of 4"):
        FluxFamily.load(tiny_flux[0], max_sequence_length=64, resolution=30)


def test_preflight_refuses_a_checkpoint_of_another_family(tiny_checkpoint, tmp_path):
    """Before anything is written: one line naming the pipeline found and the setting to change."""
    res = CliRunner().invoke(app, ["train", "--iterations", "1", "--workdir", str(tmp_path / "wd"),
                                   "model.family=flux1", f"model.path={tiny_checkpoint}"])
    assert res.exit_code == 2, res.output
    assert "StableDiffusion3Pipeline, not a FluxPipeline" in " ".join(res.output.split())
    assert not (tmp_path / "wd").exists()


@pytest.mark.parametrize("guidance", [1.0, 3.5])
def test_ode_sampling_equals_flux_pipeline(family, guidance):
    seeds = [11, 12]
    ref = _pipeline(family, guidance, seeds, "latent")  # packed [B, (H/2)(W/2), 4C]
    recipe = SamplerRecipe(steps=6, noise_level=0.0, guidance_scale=guidance, train_steps=())
    traj = sample(family, family.encode_prompts(PROMPTS), None, [torch.Generator().manual_seed(s) for s in seeds],
                  recipe)
    assert traj.final.shape == (2, *family.latent_shape()) == (2, 4, 16, 16)
    packed = family.pipe._pack_latents(traj.final, 2, *family.latent_shape())
    assert (packed - ref).abs().max().item() <= 1e-5
    if guidance > 1:  # the embedded guidance reaches the model
        plain = sample(family, family.encode_prompts(PROMPTS), None,
                       [torch.Generator().manual_seed(s) for s in seeds], SamplerRecipe(6, 0.0, train_steps=()))
        assert (plain.final - traj.final).abs().max().item() > 1e-4


def test_non_square_ode_equals_flux_pipeline(tiny_flux):
    """The packed sequence of a 32×48 image: its ids and its dynamic shift's μ as the pipeline's."""
    fam = wide(FluxFamily, tiny_flux[0], 32, 48, max_sequence_length=64)
    ref = _pipeline(fam, 3.5, [11, 12], "latent")
    traj = sample(fam, fam.encode_prompts(PROMPTS), None, gens([11, 12]),
                  SamplerRecipe(steps=6, noise_level=0.0, guidance_scale=3.5, train_steps=()))
    assert traj.final.shape == (2, 4, 16, 24)
    assert (fam.pipe._pack_latents(traj.final, 2, *fam.latent_shape()) - ref).abs().max().item() <= 1e-5
    with pytest.raises(ModelLoadError, match="model.height=32, model.width=30: .*each side a multiple of 4"):
        FluxFamily.load(tiny_flux[0], max_sequence_length=64, resolution=(32, 30))


def test_decode_equals_the_pipeline_images(family):
    seeds = [3, 4]
    ref = (_pipeline(family, 3.5, seeds, "np") * 255).round().astype("uint8")
    traj = sample(family, family.encode_prompts(PROMPTS), None, [torch.Generator().manual_seed(s) for s in seeds],
                  SamplerRecipe(6, 0.0, guidance_scale=3.5, train_steps=()))
    imgs = family.decode(traj.final)
    assert imgs.shape == (2, 32, 32, 3) and imgs.dtype.name == "uint8"
    assert (imgs.astype(int) - ref.astype(int)).__abs__().max() <= 1


def test_schedule_uses_the_pipelines_dynamic_shift(family):
    sigmas, timesteps = family.schedule(4)
    sched = family.pipe.scheduler
    sched.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=family.describe()["mu"])
    assert torch.allclose(sigmas, sched.sigmas.float()) and torch.allclose(timesteps, sched.timesteps.float())
    assert sigmas[-1] == 0 and sigmas[1] > 0.75  # shifted towards noise


@pytest.mark.parametrize("sde_type,window", [("sde", None), ("cps", None), ("sde", (1, 2))])
def test_replayed_log_probs_equal_stored(family, sde_type, window):
    """SDE at every step, CPS, and an SDE window (Flow-GRPO-Fast: ODE outside steps 1–2)."""
    recipe = SamplerRecipe(steps=4, noise_level=0.9, sde_type=sde_type, guidance_scale=3.5, sde_steps=window,
                           train_steps=window or (0, 1, 2))
    cond = family.encode_prompts(PROMPTS)
    traj = sample(family, cond, None, [torch.Generator().manual_seed(i) for i in range(2)], recipe)
    for j, k in enumerate(traj.stored_steps):
        out = replay_step(family, traj.latents[:, j], traj.next_latents[:, j], k, traj.sigmas, traj.timesteps,
                          cond, None, recipe)
        assert torch.equal(out.log_prob.detach(), traj.log_probs[:, j])
        loss, m = ppo_clip_loss(out.log_prob, traj.log_probs[:, j], torch.ones(2), 1e-4)
        assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0
        loss.backward()
    assert any(p.grad is not None for p in family.transformer.parameters())
    family.transformer.zero_grad(set_to_none=True)


def test_lora_targets_exist_in_the_transformer(family):
    names = [n for n, _ in family.transformer.named_modules()]
    for target in FluxFamily.lora_targets:
        assert any(n.endswith(target) for n in names), f"LoRA target {target} matches no module"


def test_incomplete_checkout_names_the_missing_component(tiny_flux, tmp_path):
    import shutil

    broken = tmp_path / "flux"
    shutil.copytree(tiny_flux[0], broken)
    shutil.rmtree(broken / "text_encoder_2")
    with pytest.raises(ModelLoadError, match=r"lacks text_encoder_2/ \(T5EncoderModel\).*flux1"):
        FluxFamily.load(broken, max_sequence_length=64)


def test_a_component_from_another_checkpoint_is_named_before_any_work(tiny_flux, tmp_path):
    """A mismatched text encoder (CLIP where the pipeline declares T5) fails in preflight, naming it."""
    import shutil

    broken = tmp_path / "flux"
    shutil.copytree(tiny_flux[0], broken)
    shutil.rmtree(broken / "text_encoder_2")
    shutil.copytree(broken / "text_encoder", broken / "text_encoder_2")
    with pytest.raises(ModelLoadError, match=r"text_encoder_2/ holds a clip_text_model model.*T5EncoderModel \(t5\)"):
        FluxFamily.load(broken, max_sequence_length=64)
    res = CliRunner().invoke(app, ["train", "--iterations", "1", "--workdir", str(tmp_path / "wd"),
                                   "model.family=flux1", f"model.path={broken}", "model.max_sequence_length=64"])
    assert res.exit_code == 2 and "text_encoder_2/" in res.output and not (tmp_path / "wd").exists()


def test_tiny_cli_writes_a_loadable_checkpoint_and_never_overwrites(tmp_path):
    out = tmp_path / "flux"
    res = CliRunner().invoke(app, ["tiny", "flux1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    overrides = json.loads(res.stdout.strip().splitlines()[-1])
    assert overrides["model.family"] == "flux1" and (out / "transformer" / "config.json").is_file()
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
    assert not list(tmp_path.glob(".*partial"))
    res = CliRunner().invoke(app, ["tiny", "flux1", "--out", str(out)])
    assert res.exit_code == 2 and "already exists" in res.output
    res = CliRunner().invoke(app, ["tiny", "fluxx", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "flux1" in res.output and not (tmp_path / "x").exists()


def test_two_rl_iterations_full_fine_tune_through_the_unchanged_flow(tiny_flux, tmp_path, prefect_harness):
    path, overrides = tiny_flux
    extra = {k: v for k, v in overrides.items() if k != "model.path"}
    args = ["train", "--iterations", "2", "--run", "flux", "reward=jpeg_compressibility",
            *tiny_overrides(path, tmp_path, **extra), "sampling.guidance_scale=3.5"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    t = lance.dataset(out["table_uri"]).to_table()
    assert t.num_rows == 16 and set(t["family"].to_pylist()) == {"flux1"}
    assert all(t[c].null_count == 0 for c in ("image", "reward", "advantage", "log_probs"))
    from mlflow.tracking import MlflowClient

    versions = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_model_versions(f"name='{out['model_name']}'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    recipe = json.loads(t["recipe"][0].as_py())
    assert recipe["resolution"] == [4, 16, 16] and recipe["guidance_scale"] == 3.5
    assert t["latents"].combine_chunks().to_numpy_ndarray().shape[2:] == (4, 16, 16)
    ck = next((tmp_path / "checkpoints" / "flux").glob("*/it_0001"))
    trained = load_file(str(ck / "trainable.safetensors"))
    base = load_file(str(path / "transformer" / "diffusion_pytorch_model.safetensors"))
    changed = [k for k, v in trained.items() if k in base and not torch.equal(v, base[k])]
    assert changed, "the update changed no FLUX transformer weight"
