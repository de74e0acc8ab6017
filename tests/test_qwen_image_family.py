"""The Qwen-Image family on a tiny random checkpoint written by `pixrl tiny qwen_image` in the
diffusers layout: prompt encoding (the chat template's 34 tokens dropped), ODE parity with
diffusers' QwenImagePipeline with and without true CFG (norm-rescaled, in packed space), decode
parity (latent mean/std, one-frame causal VAE), the on-policy ratio, and one RL iteration."""

import json

import lance
import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_overrides
from family_checks import assert_replay_is_on_policy, wide
from pixrl.algorithms.sampling import SamplerRecipe, sample
from pixrl.cli import app
from pixrl.models.base import ModelLoadError, uses_negative_prompt
from pixrl.models.qwen_image import QwenImageFamily
from pixrl.models.registry import get_family

PROMPTS = ["a red circle", "two blue squares in the sky"]  # different lengths: a padding mask


@pytest.fixture(scope="module")
def family(tiny_qwen_image):
    path, overrides = tiny_qwen_image
    return QwenImageFamily.load(path, max_sequence_length=overrides["model.max_sequence_length"],
                                resolution=overrides["model.resolution"])


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def _pipeline(family, cond, negative: str | None, cfg: float, seeds, output_type: str):
    """The pipeline given our prompt encodings, encoding its negative prompt itself (true CFG)."""
    kw = {"prompt_embeds": cond.prompt_embeds, "prompt_embeds_mask": cond.mask}
    if negative is not None:
        kw.update(negative_prompt=negative)
    return family.pipe(num_inference_steps=6, true_cfg_scale=cfg, generator=_gens(seeds), output_type=output_type,
                       height=family.height, width=family.width,
                       max_sequence_length=family.max_sequence_length, **kw).images


def test_registered_and_guided_by_a_negative_prompt():
    assert get_family("qwen_image") is QwenImageFamily
    assert uses_negative_prompt(QwenImageFamily, 4.0) and not uses_negative_prompt(QwenImageFamily, 1.0)


def test_encoding_is_the_pipelines_and_drops_the_template(family):
    cond = family.encode_prompts(PROMPTS)
    embeds, mask = family.pipe.encode_prompt(prompt=PROMPTS, device=family.device,
                                             max_sequence_length=family.max_sequence_length)
    assert torch.equal(cond.prompt_embeds, embeds) and torch.equal(cond.mask, mask)
    template = family.pipe.prompt_template_encode.split("{}")[0]
    assert len(family.pipe.tokenizer(template).input_ids) == family.pipe.prompt_template_encode_start_idx == 34
    assert cond.mask.sum(1).tolist()[0] < cond.mask.sum(1).tolist()[1]  # the prompts' own tokens differ
    assert not torch.equal(family.encode_negative("").prompt_embeds[0, :3], cond.prompt_embeds[0, :3])


@pytest.mark.parametrize("cfg,negative", [(1.0, None), (4.0, ""), (4.0, "blurry, low quality")])
def test_ode_sampling_equals_qwen_image_pipeline(family, cfg, negative):
    seeds = [11, 12]
    cond = family.encode_prompts(PROMPTS)
    neg = family.encode_negative(negative).expand(2) if cfg > 1 else None
    ref = _pipeline(family, cond, negative, cfg, seeds, "latent")
    traj = sample(family, cond, neg, _gens(seeds), SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert traj.final.shape == (2, *family.latent_shape()) == (2, 4, 16, 16)
    assert (family.pipe._pack_latents(traj.final, 2, *family.latent_shape()) - ref).abs().max().item() <= 1e-5
    if cfg > 1:
        plain = sample(family, cond, None, _gens(seeds), SamplerRecipe(6, 0.0, train_steps=()))
        assert (plain.final - traj.final).abs().max().item() > 1e-4


def test_non_square_ode_equals_qwen_image_pipeline(tiny_qwen_image):
    """img_shapes and the dynamic shift's μ of a 48×32 image, as the pipeline's."""
    fam = wide(QwenImageFamily, tiny_qwen_image[0], 48, 32,
               max_sequence_length=tiny_qwen_image[1]["model.max_sequence_length"])
    cond, neg = fam.encode_prompts(PROMPTS), fam.encode_negative("").expand(2)
    ref = _pipeline(fam, cond, "", 4.0, [11, 12], "latent")
    traj = sample(fam, cond, neg, _gens([11, 12]), SamplerRecipe(6, 0.0, guidance_scale=4.0, train_steps=()))
    assert traj.final.shape == (2, 4, 24, 16)
    assert (fam.pipe._pack_latents(traj.final, 2, *fam.latent_shape()) - ref).abs().max().item() <= 1e-5


def test_decode_equals_the_pipeline_images(family):
    cond, neg = family.encode_prompts(PROMPTS), family.encode_negative("").expand(2)
    ref = (_pipeline(family, cond, "", 4.0, [3, 4], "np") * 255).round().astype("uint8")
    traj = sample(family, cond, neg, _gens([3, 4]), SamplerRecipe(6, 0.0, guidance_scale=4.0, train_steps=()))
    imgs = family.decode(traj.final)
    assert imgs.shape == (2, 32, 32, 3) and imgs.dtype.name == "uint8"
    assert abs(imgs.astype(int) - ref.astype(int)).max() <= 1


def test_replayed_log_probs_equal_stored_with_cfg(family):
    recipe = SamplerRecipe(steps=4, noise_level=1.2, guidance_scale=4.0, train_steps=(0, 1, 2))
    assert_replay_is_on_policy(family, family.encode_prompts(PROMPTS), family.encode_negative("").expand(2), recipe)


def test_lora_targets_and_layout_errors(family, tiny_flux):
    names = [n for n, _ in family.transformer.named_modules()]
    for target in QwenImageFamily.lora_targets:
        assert any(n.endswith(target) for n in names), f"LoRA target {target} matches no module"
    with pytest.raises(ModelLoadError, match="FluxPipeline, not a QwenImagePipeline"):
        QwenImageFamily.load(tiny_flux[0])


def test_two_rl_iterations_with_lora_and_cfg_through_the_unchanged_flow(tiny_qwen_image, tmp_path, prefect_harness):
    """LoRA on the family's targets: the checkpoints hold adapter weights only, and they moved."""
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    path, overrides = tiny_qwen_image
    extra = {k: v for k, v in overrides.items() if k != "model.path"}
    args = ["train", "--iterations", "2", "--run", "qwen", "reward=jpeg_compressibility", "algorithm=flow_grpo_lora",
            "algorithm.lora.rank=4", "algorithm.lora.alpha=8", *tiny_overrides(path, tmp_path, **extra),
            "sampling.guidance_scale=4.0"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    t = lance.dataset(out["table_uri"]).to_table()
    assert t.num_rows == 16 and set(t["family"].to_pylist()) == {"qwen_image"}
    assert json.loads(t["recipe"][0].as_py())["guidance_scale"] == 4.0
    assert all(t[c].null_count == 0 for c in ("image", "reward", "advantage", "log_probs"))
    versions = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_model_versions(f"name='{out['model_name']}'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    cks = sorted((tmp_path / "checkpoints" / "qwen").glob("*/it_*"))
    first, last = (load_file(str(c / "trainable.safetensors")) for c in (cks[0], cks[-1]))
    assert first and all("lora" in k for k in first)
    assert any(not torch.equal(first[k], last[k]) for k in first)
