"""A process that only trains (a Ray trainer rank) holds no text towers: each diffusers family
loads without its text encoders and refuses to encode, naming why; the encodings another process
exports arrive bit for bit (the negative prompt's too) and give the same velocities; an update
given them equals the update that encodes for itself, bit for bit, across dynamic-sampling
prompt sets. (The Ray engine's 2-rank update, whose ranks hold no towers, is in test_ray_engine.)"""

import dataclasses

import numpy as np
import pytest
import torch

from conftest import tiny_overrides
from pixrl.algorithms.sampling import SamplerRecipe
from pixrl.config.loader import load_config
from pixrl.engines.base import PolicySource
from pixrl.engines.local import LocalEngine
from pixrl.engines.policy import TrainablePolicy
from pixrl.engines.prompt_cache import PromptCache
from pixrl.engines.update import replay_prompt_sets
from pixrl.models.base import uses_negative_prompt
from pixrl.models.registry import get_family

PIPELINE_FAMILIES = ["sd3", "sd15", "sdxl", "flux1", "flux2", "qwen_image", "sana", "wan", "z_image", "hunyuan_video15",
                     "flux2_klein", "lumina2", "hunyuan_video", "pixart_sigma", "ltx_video", "mochi", "cogvideox", "cosmos2", "cosmos25", "glm_image", "hunyuan_image", "ltx2"]
PROMPTS = ["a red circle", "two blue squares in the sky", "a red circle"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    def get(family: str):
        out = tmp_path_factory.mktemp("ckpt") / f"tiny-{family}"
        return get_family(family).write_tiny(out, seed=0)
    cache = {}
    return lambda family: cache.setdefault(family, get(family))


def _tensors(cond) -> dict[str, torch.Tensor]:
    return {f.name: getattr(cond, f.name) for f in dataclasses.fields(cond)}


def _equal(a, b) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return ta.keys() == tb.keys() and all((ta[k] is None and tb[k] is None) or torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize("family", PIPELINE_FAMILIES)
def test_a_family_loaded_without_text_towers_replays_with_given_encodings(family, tiny_dirs):
    cfg = load_config(None, [f"{k}={v}" for k, v in tiny_dirs(family).items()])
    full = TrainablePolicy(cfg).family
    bare = TrainablePolicy(cfg, text_towers=False).family
    assert full.text_towers() and not bare.text_towers()
    assert not any(k.startswith("text_encoder") and v is not None for k, v in bare.pipe.components.items())
    with pytest.raises(RuntimeError, match=f"this {family} model was loaded without its text encoders"):
        bare.encode_prompts(PROMPTS[:1])
    scale, text = 4.0, "blurry, low quality"
    negative = text if uses_negative_prompt(full, scale) else None
    exported = PromptCache(full).encodings([PROMPTS], negative)
    assert [u for u, _ in exported["sets"]] == [sorted(set(PROMPTS))]
    assert exported["negative"] is None if negative is None else exported["negative"][0] == text
    held_conds = [c for _, c in exported["sets"]] + ([exported["negative"][1]] if negative else [])
    assert all(t.device.type == "cpu" for c in held_conds for t in _tensors(c).values() if t is not None)
    held, own = PromptCache.holding(bare, exported), PromptCache(full)
    (got, got_pos), (want, want_pos) = held.encode(PROMPTS[::-1]), own.encode(PROMPTS)  # a set, in any order
    assert got_pos == want_pos and _equal(got, want)
    neg = held.negative(text) if negative else None
    if negative:
        assert _equal(neg, own.negative(text)) and _equal(neg, full.encode_negative(text))
        with pytest.raises(RuntimeError, match="loaded without its text encoders"):
            held.negative("a negative prompt the rollout never encoded")
    with pytest.raises(RuntimeError, match="loaded without its text encoders"):
        held.encode(["a prompt the rollout never encoded"])
    _, timesteps = full.schedule(4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn((2, *full.latent_shape()), generator=g)
    t = timesteps[1].repeat(2)
    rows = [want_pos[p] for p in PROMPTS[:2]]
    v_full = full.velocity(x, t, want.select(rows), scale, own.negative(text).expand(2) if negative else None)
    v_bare = bare.velocity(x, t, got.select(rows), scale, neg.expand(2) if negative else None)
    assert torch.equal(v_full, v_bare)


@pytest.mark.parametrize("family", PIPELINE_FAMILIES)
def test_a_rollout_worker_without_text_towers_samples_with_given_encodings(family, tiny_dirs):
    """Ray rollout workers after the first: the call's conditioning and an evaluation shard's come
    from a process with the towers (worker 0), and the rows and images are its own, bit for bit."""
    cfg = load_config(None, [f"{k}={v}" for k, v in tiny_dirs(family).items()] + ["sampling.eval_steps=2"])
    full, bare = LocalEngine(cfg), LocalEngine(cfg)
    bare.text_towers = False
    recipe = SamplerRecipe(steps=4, noise_level=0.7, guidance_scale=4.0, sde_steps=(0, 1), train_steps=(0, 1),
                           negative_prompt="blurry, low quality")
    seeds = [5, 6, 7]
    want, _ = full.rollout(PolicySource(), PROMPTS, seeds, recipe)
    got, _ = bare.rollout(PolicySource(), PROMPTS, seeds, recipe,
                          encodings=full.encodings([PROMPTS], recipe))
    assert not bare.policy.family.text_towers()
    for name in ("latents", "next_latents", "log_probs", "final_latent"):
        assert np.array_equal(got[name], want[name]), name
    pairs = [({"prompt": p}, s) for p, s in zip(PROMPTS, seeds)]
    images = bare.eval_images(PolicySource(), "shapes", pairs, full.eval_encodings("shapes", pairs))
    assert np.array_equal(images, full.eval_images(PolicySource(), "shapes", pairs))


def test_an_update_given_the_rollouts_encodings_equals_one_that_encodes(tiny_checkpoint, tmp_path):
    """CFG 4.5 (the negative prompt travels too); two prompt sets, as two dynamic-sampling rounds
    encode them; full fine-tune with a KL reference."""
    cfg = load_config(None, tiny_overrides(tiny_checkpoint, tmp_path) + ["reward=jpeg_compressibility",
                                                                        "algorithm.beta=0.01"])
    recipe = SamplerRecipe(steps=4, noise_level=0.7, guidance_scale=4.5, sde_steps=(0, 1), train_steps=(0, 1),
                           negative_prompt="blurry, low quality")
    prompts = ["a red circle", "a blue square"] * 2 + ["two green triangles", "a yellow circle"] * 2
    sets = np.array([0] * 4 + [1] * 4)
    local = LocalEngine(cfg)
    parts = [local.rollout(PolicySource(), [p for p, s in zip(prompts, sets) if s == k], list(range(4)), recipe)[0]
             for k in (0, 1)]  # each round's rollout encodes its own set
    from pixrl.artifacts.batch import RolloutBatch

    batch = RolloutBatch.concat(parts).with_columns(prompt=prompts,
                                                    advantage=np.linspace(-1, 1, 8).astype(np.float32))
    plan = [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    exported = local.encodings(list(replay_prompt_sets(prompts, sets).values()), recipe)
    assert len(exported["sets"]) == 2 and exported["negative"][0] == "blurry, low quality"
    want = local.train(PolicySource(), batch, plan, recipe, seed=3, prompt_sets=sets)
    trainer = LocalEngine(cfg)
    trainer.text_towers = False
    with pytest.raises(RuntimeError, match="loaded without its text encoders"):
        trainer.train(PolicySource(), batch, plan, recipe, seed=3, prompt_sets=sets)
    got = trainer.train(PolicySource(), batch, plan, recipe, seed=3, prompt_sets=sets, encodings=exported)
    assert not trainer.policy.family.text_towers()
    assert got.weights.keys() == want.weights.keys()
    assert all(torch.equal(got.weights[k], want.weights[k]) for k in want.weights)
    timing = {"update_compute_s"}
    assert {k: v for k, v in got.metrics.items() if k not in timing} == \
        {k: v for k, v in want.metrics.items() if k not in timing}
    assert got.metrics["onpolicy_ratio_dev"] == 0.0 and got.metrics["optimizer_steps"] == 2.0


def test_a_cfg_free_update_that_guides_its_reference_gets_the_negative_prompt_too(tiny_checkpoint, tmp_path):
    """DGPO's dgpo_wocfg (rollouts at guidance 1, the KL reference guided at 4.5): the rollout batched
    no negative prompt, yet the exported encodings carry it for the reference, and a trainer
    without text towers given them updates bit for bit as one that encodes."""
    from pixrl.algorithms.recipe import ode_recipe
    from pixrl.config.schema import SamplingConfig

    cfg = load_config(None, tiny_overrides(tiny_checkpoint, tmp_path) + [
        "reward=jpeg_compressibility", "algorithm=dgpo", "algorithm.kl_guidance=4.5", "algorithm.lora.enabled=false",
        "algorithm.train_levels=2", "algorithm.trunc_steps=2", "algorithm.optimizer_steps_per_iteration=1"])
    recipe = ode_recipe(SamplingConfig(steps=4, guidance_scale=1.0), "dpm2")  # the empty negative prompt
    local = LocalEngine(cfg)
    prompts = ["a red circle"] * 2 + ["two blue squares"] * 2
    rows, _ = local.rollout(PolicySource(), prompts, list(range(4)), recipe)
    batch = rows.with_columns(prompt=prompts, group_id=np.array([0, 0, 1, 1], dtype=np.int32),
                              advantage=np.array([1.0, -1.0, 0.5, -0.5], dtype=np.float32))
    exported = local.encodings([sorted(set(prompts))], recipe)
    assert exported["negative"][0] == ""  # for the reference: the rollout batched none
    plain = LocalEngine(load_config(None, tiny_overrides(tiny_checkpoint, tmp_path) + ["algorithm=dgpo"]))
    assert plain.encodings([sorted(set(prompts))], recipe)["negative"] is None
    want = local.train(PolicySource(), batch, [[[0, 1, 2, 3]]], recipe, seed=3)
    trainer = LocalEngine(cfg)
    trainer.text_towers = False
    got = trainer.train(PolicySource(), batch, [[[0, 1, 2, 3]]], recipe, seed=3, encodings=exported)
    assert all(torch.equal(got.weights[k], want.weights[k]) for k in want.weights)
    assert got.metrics["kl"] == want.metrics["kl"] > 0
