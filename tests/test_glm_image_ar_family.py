"""GLM-Image's autoregressive model as a token family, on the tiny checkpoint of `pixrl tiny
glm_image` (`model.family=glm_image_ar`): prompts and 3-D positions as the pipeline's processor
and the model's own rope index give them; teacher-forced logits equal the step logits of
transformers' `generate` (the pipeline's sampler); the incremental decode agrees with them; the
image marks never sampled; samples independent of their batch; decode equal to GlmImagePipeline
given the tokens' prior; the unguided sampling it has enforced before any work; and two
Token-GRPO iterations through the unchanged flow, LoRA and full."""

import json

import numpy as np
import pytest
import torch

from conftest import two_iterations
from family_checks import gens
from pixrl.algorithms.token_sampling import TokenRecipe, sample_tokens, sequence_log_probs
from pixrl.config.loader import load_config
from pixrl.models.base import ModelLoadError, decode_images
from pixrl.models.glm_image import prompt_seed
from pixrl.models.glm_image_ar import GlmImageArFamily
from pixrl.models.registry import get_family

PROMPTS = ["a sign that says 'hello world'", "a red circle"]


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-glm-image"
    return out, GlmImageArFamily.write_tiny(out, seed=0)


@pytest.fixture(scope="module")
def family(tiny_glm):
    return GlmImageArFamily.load(tiny_glm[0], max_sequence_length=64, resolution=64, decoder_steps=4)


def _inputs(family, prompt: str):
    turn = [[{"role": "user", "content": [{"type": "text", "text": prompt}]}]]
    return family.pipe.processor.apply_chat_template(turn, tokenize=True, target_h=family.height, target_w=family.width,
                                                     return_dict=True, return_tensors="pt")


def _generate(family, prompt: str, seed: int):
    """transformers' generate as the pipeline calls it (global seed, do_sample), with its step logits."""
    inputs = _inputs(family, prompt)
    torch.manual_seed(seed)
    out = family.transformer.generate(**inputs, max_new_tokens=family.image_token_count() + 1, do_sample=True,
                                      output_logits=True, return_dict_in_generate=True)
    n = family.image_token_count()
    return out.sequences[:, inputs["input_ids"].shape[1]:][:, :n], torch.stack(out.logits[:n], 1).float()


def test_registered_as_a_token_policy_over_the_language_model(tiny_glm, family):
    assert get_family("glm_image_ar") is GlmImageArFamily and family.semantics.step.value == "token"
    assert family.image_token_count() == 16 * 16 + 2 * 2 and family.latent_shape() == (260,)
    assert family.lora_targets and all(n.startswith("model.language_model.") for n in family.lora_targets)
    wide = GlmImageArFamily.load(tiny_glm[0], max_sequence_length=64, resolution=(64, 128))
    assert (wide.grid, wide.preview, wide.image_token_count()) == ((2, 4), (11, 22), 11 * 22 + 2 * 4)


def test_prompts_and_positions_are_the_pipelines_each_prompt_alone(family):
    cond = family.encode_prompts(PROMPTS)
    model = family.transformer.model
    for i, p in enumerate(PROMPTS):
        inputs = _inputs(family, p)
        ids = inputs["input_ids"][0]
        assert torch.equal(cond.ids[i, cond.mask[i].bool()], ids) and int(cond.mask[i].sum()) == len(ids)
        pos, _ = model.get_rope_index(inputs["input_ids"], inputs["image_grid_thw"], torch.tensor([2]))
        assert torch.equal(cond.positions[:, i, cond.mask[i].bool()], pos[:, 0])
        assert torch.equal(cond.decode[i], model._cached_decode_position_ids[0])
    assert cond.ids.shape[1] > int(cond.mask[1].sum())  # the shorter prompt is left-padded


def test_teacher_forced_logits_equal_the_pipelines_sampler_and_its_incremental_decode(family):
    tokens, ref = _generate(family, PROMPTS[1], seed=5)
    assert tokens.shape == (1, 260) and int(tokens.max()) < family.codebook
    batch = family.encode_prompts(PROMPTS)  # scored beside a longer prompt: left-padded
    both = family.sequence_logits(batch, torch.cat([tokens, tokens]), guided=False)[1:]
    alone = family.sequence_logits(family.encode_prompts(PROMPTS[1:]), tokens, guided=False)
    for got in (alone, both):
        assert torch.isinf(got[..., family.codebook:]).all()  # the image marks are out of the distribution
        assert (got[..., :family.codebook] - ref[..., :family.codebook]).abs().max().item() <= 1e-5
    traj = sample_tokens(family, batch, gens([3, 4]), TokenRecipe(temperature=0.8, top_k=16))
    assert float((traj.log_probs - traj.sampler_log_probs).abs().max()) <= 1e-5
    lp, _ = sequence_log_probs(family, batch, traj.tokens, TokenRecipe(temperature=0.8, top_k=16))
    assert torch.equal(lp, traj.log_probs)


def test_the_image_marks_are_never_sampled_and_samples_do_not_depend_on_their_batch(tiny_glm):
    fam = GlmImageArFamily.load(tiny_glm[0], max_sequence_length=64, resolution=64, decoder_steps=4)
    head = fam.transformer.lm_head.weight
    with torch.no_grad():  # the two marks' rows ±100·r: one of them far above every codebook logit
        r = head[fam.codebook].clone()
        head[fam.codebook], head[fam.codebook + 1] = 100 * r, -100 * r
    cond = fam.encode_prompts(PROMPTS)
    with torch.no_grad():
        raw = fam.transformer(input_ids=cond.ids, attention_mask=cond.mask, position_ids=cond.positions).logits[:, -1]
    assert (raw.argmax(-1) >= fam.codebook).all(), "the head does not favour the marks: the test would prove nothing"
    traj = sample_tokens(fam, cond, gens([3, 4]), TokenRecipe())
    assert int(traj.tokens.max()) < fam.codebook and torch.isfinite(traj.log_probs).all()
    alone = sample_tokens(fam, fam.encode_prompts(PROMPTS[1:]), gens([4]), TokenRecipe())
    assert torch.equal(alone.tokens[0], traj.tokens[1])


def test_decode_is_the_pipeline_given_the_tokens_prior(family):
    traj = sample_tokens(family, family.encode_prompts(PROMPTS), gens([3, 4]), TokenRecipe())
    prior = family.prior_of(traj.tokens)
    for i in range(2):
        large = traj.tokens[i, 256:]
        assert torch.equal(prior[i], family.pipe._upsample_token_ids(large, 2, 2)[0])
    images = decode_images(family, traj.tokens, PROMPTS)
    ref = np.concatenate([family.pipe(prompt=p, height=64, width=64, num_inference_steps=4, guidance_scale=1.5,
                                      prior_token_ids=prior[i:i + 1], max_sequence_length=64, output_type="np",
                                      generator=torch.Generator().manual_seed(prompt_seed(0, p))).images
                          for i, p in enumerate(PROMPTS)])
    assert images.shape == (2, 64, 64, 3) and images.dtype == np.uint8
    assert np.abs(images.astype(int) - (ref * 255).round().astype(int)).max() <= 1
    with pytest.raises(ValueError, match="decodes with each row's prompt; 2 rows came with no prompts"):
        decode_images(family, traj.tokens, None)


def test_guidance_and_a_chain_of_thought_are_refused_before_any_work(tiny_glm):
    for extra, match in [("sampling.guidance_scale=2.0", "samples its tokens without guidance"),
                         ("sampling.cot_tokens=8", "has no chain of thought")]:
        cfg = load_config(None, [f"{k}={v}" for k, v in tiny_glm[1].items()] + ["algorithm=token_grpo", extra])
        with pytest.raises(ModelLoadError, match=match):
            GlmImageArFamily.check_options(tiny_glm[0], {}, cfg.sampling)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_two_token_grpo_iterations_through_the_flow(tiny_glm, tmp_path, prefect_harness, mode):
    out, t = two_iterations(tiny_glm, tmp_path, f"glm-ar-{mode}", mode, "algorithm.lr=1e-3",
                            algorithm="token_grpo", base_weights="vision_language_encoder/model.safetensors")
    tokens = np.stack(t["tokens"].to_numpy(zero_copy_only=False))
    assert tokens.shape == (16, 260) and tokens.min() >= 0 and tokens.max() < 64
    recipe = json.loads(t["recipe"][0].as_py())
    assert (recipe["sampler"], recipe["image_tokens"], recipe["guidance_scale"]) == ("token", 260, 1.0)


def test_the_presets_train_the_autoregressive_model_without_guidance():
    cfg = load_config("glm_image_ar_pickscore", ["model.path=/x"])
    assert (cfg.model.family, cfg.model.resolution, cfg.model.decoder_steps) == ("glm_image_ar", 1024, 50)
    assert cfg.sampling.guidance_scale == 1.0 and cfg.algorithm.name == "token_grpo"
    decoder = load_config("glm_image_ocr", ["model.path=/x"])  # the same checkpoint's decoder, trained for text
    assert (decoder.model.family, decoder.sampling.guidance_scale) == ("glm_image", cfg.model.decoder_guidance)


def test_a_sharded_trainer_rank_builds_the_model_without_reading_weights(tiny_glm, family):
    """A Ray FSDP rank other than 0 loads the trained transformers model on the meta device (its
    weights come from rank 0): the same parameter names and shapes, no storage."""
    bare = GlmImageArFamily.load(tiny_glm[0], max_sequence_length=64, resolution=64, trainable_device="meta")
    params = dict(bare.transformer.named_parameters())
    assert all(p.is_meta for p in params.values())
    assert {n: p.shape for n, p in params.items()} == {n: p.shape for n, p in family.transformer.named_parameters()}
