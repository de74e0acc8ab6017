"""SRPO (Direct-Align + Semantic Relative Preference) on the tiny SD3 checkpoint with a tiny random
CLIP as its reward model: the loss terms equal SRPO.py's operations written out here — noise
injected with the sample's own ε, one Euler step of the velocity, the analytic recovery, the VAE
decode and the reward's SRP score of the control-word captions — value and gradient; the reward's
differentiable image path equals its processor's; two iterations through the real flow move the
weights, and a fault in update resumes bit for bit; misuse is refused before a run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import fault_then_resume, tiny_overrides
from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.replay import ReplayPolicy
from pixrl.algorithms.sampling import SamplerRecipe, generators, initial_noise, sample
from pixrl.cli import app
from pixrl.config.schema import AlgorithmConfig
from pixrl.models.sd3 import SD3Family
from pixrl.rewards.clip_tiny import write_tiny_clip
from pixrl.rewards.compose import RewardSet

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]
SETTINGS = dict(name="srpo", reward="clip_score", grid_steps=8, train_window=(1, 6), timestep_length=100)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return write_tiny_clip(tmp_path_factory.mktemp("clip") / "clip", seed=0, image_size=16)


@pytest.fixture(scope="module")
def family(tiny_checkpoint):
    return SD3Family.load(tiny_checkpoint, max_sequence_length=0)


def _bound(clip_dir, **settings):
    algo = build_algorithm(AlgorithmConfig(**{**SETTINGS, **settings}))
    rewards = RewardSet({"clip_score": 1.0}, {"clip_score": {"path": str(clip_dir)}})
    algo.check_rewards(rewards)
    algo.bind_rewards(rewards)
    return algo, rewards.rewards["clip_score"]


def _reference_terms(fam, model, proc, x0, eps, cond, algo, mid, gap, pos, neg):
    """SRPO.py's SRPO_train for each branch, written out: σ_l, the noised latent, one Euler step,
    the recovery, the decode, CLIP's features and the SRP score, relu(0.7 − s)."""
    c, n = algo.settings, algo.settings.timestep_length
    sig, _ = fam.schedule(c.grid_steps)
    sigmas_l = torch.linspace(float(sig[c.train_window[0]]), float(sig[c.train_window[1]]), n)

    def text(captions):
        tok = proc.tokenizer(captions, padding=True, return_tensors="pt")
        e = model.get_text_features(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
        return torch.nn.functional.normalize(getattr(e, "pooler_output", e), dim=-1)

    t_pos, t_neg = text(pos), text(neg)
    scale = float(model.logit_scale.exp()) / 20
    out = []
    for inversion in (1, 0):  # SRPO.py's order: reversed(range(2))
        terms = []
        for i in range(len(x0)):
            m = int(mid[i]) if inversion else max(int(mid[i]) - int(gap[i]), 1)
            start = min(m + int(gap[i]), n)
            t_base, t_start = n - m, n - start
            if inversion == 0:  # inject at t_base, step back to t_start, recover with σ(t_start)·ε
                s_in, s_gt = sigmas_l[t_base], sigmas_l[t_start]
            else:  # inject at t_start, step down to t_base, recover with σ(t_base)·ε
                s_in, s_gt = sigmas_l[t_start], sigmas_l[t_base]
            noisy = s_in * eps[i:i + 1] + (1 - s_in) * x0[i:i + 1]
            v = fam.velocity(noisy, (s_in * 1000).reshape(1), cond.select([i]), 1.0, None)
            stepped = noisy + (s_gt - s_in) * v
            x0_hat = (stepped - s_gt * eps[i:i + 1]) / (1 - s_gt)
            vc = fam.vae.config
            image = (fam.vae.decode(x0_hat / vc.scaling_factor + vc.shift_factor).sample / 2 + 0.5).clamp(0, 1)
            ip = proc.image_processor
            pixels = (image - torch.tensor(ip.image_mean).view(1, 3, 1, 1)) / torch.tensor(ip.image_std).view(1, 3, 1, 1)
            img = torch.nn.functional.normalize(
                getattr(e := model.get_image_features(pixel_values=pixels), "pooler_output", e), dim=-1)
            if inversion == 1:
                k = torch.linspace(*c.discount_pos, n)[m]
                score = scale * img[0] @ ((1 + k) * t_pos[i] - t_neg[i])
            else:
                k = torch.linspace(*c.discount_inv, n)[m]
                score = scale * img[0] @ ((1 + k) * t_neg[i] - t_pos[i])
            terms.append(torch.relu(0.7 - score))
        out.append(torch.stack(terms).mean())
    return out


def test_the_loss_terms_are_srpos_direct_align_and_srp(family, clip_dir):
    from transformers import CLIPModel, CLIPProcessor

    algo, reward = _bound(clip_dir)
    cond = family.encode_prompts(PROMPTS)
    seeds = [3, 4, 5]
    x0 = sample(family, cond, None, generators(seeds), SamplerRecipe(4, 0.0, train_steps=())).final
    batch = {"final_latent": x0.numpy(), "seed": np.array(seeds), "prompt": np.array(PROMPTS)}
    policy = ReplayPolicy(family, None, cond, None, None, None, SamplerRecipe(4, 0.0, train_steps=()),
                          torch.device("cpu"), torch.Generator().manual_seed(11))
    params = [p for p in family.transformer.parameters() if p.requires_grad]
    got, grads, branches = [], [], []
    for loss, metrics in algo.losses(batch, policy):
        family.transformer.zero_grad()
        loss.backward()
        got.append(loss.detach())
        grads.append([p.grad.clone() for p in params])
        branches.append({k.split("_")[0] for k in metrics})
    assert branches == [{"srpo/denoise"}, {"srpo/inversion"}]
    assert len(got) == algo.terms(batch) == 2
    mid, gap, pos, neg = algo.draws(PROMPTS, torch.Generator().manual_seed(11))
    assert all(p.startswith(tuple(algo.settings.positive_words)) and p.endswith(q) for p, q in zip(pos, PROMPTS))
    eps = initial_noise(generators(seeds), tuple(x0.shape[1:]))
    model = CLIPModel.from_pretrained(str(clip_dir)).eval().requires_grad_(False)  # frozen, as the reward's
    proc = CLIPProcessor.from_pretrained(str(clip_dir))
    ref = _reference_terms(family, model, proc, x0, eps, cond, algo, mid, gap, pos, neg)
    for loss, want, grad in zip(got, ref, grads):
        family.transformer.zero_grad()
        want.backward()
        assert abs(float(loss) - float(want)) < 1e-6 and 0 < float(want) < 2
        assert all(torch.allclose(g, p.grad, atol=1e-7, rtol=1e-4) for g, p in zip(grad, params))
        assert any(float(g.abs().max()) > 0 for g in grad)  # the reward's gradient reached the velocity
    family.transformer.zero_grad()
    assert reward.srp_scale() == pytest.approx(float(model.logit_scale.exp()) / 20)


def test_the_differentiable_image_path_is_the_processors(clip_dir):
    from pixrl.rewards.clip_backbone import ClipBackbone

    clip = ClipBackbone(str(clip_dir))
    images = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    assert torch.allclose(clip.pixel_embeds(pixels), clip.image_embeds(images), atol=1e-6)
    other = np.random.default_rng(1).integers(0, 256, (2, 40, 24, 3), dtype=np.uint8)  # resized, then cropped
    moved = torch.from_numpy(other).permute(0, 3, 1, 2).float().div(255).requires_grad_(True)
    emb = clip.pixel_embeds(moved)
    assert emb.shape == (2, 24) and (emb * clip.image_embeds(other)).sum(-1).min() > 0.98  # PIL's resampling
    emb.sum().backward()
    assert moved.grad.abs().sum() > 0


def test_two_iterations_train_and_a_fault_in_update_resumes_bit_for_bit(tiny_checkpoint, clip_dir, tmp_path,
                                                                      monkeypatch, prefect_harness):
    import lance
    from safetensors.torch import load_file

    def train(wd, run):
        return CliRunner().invoke(app, [
            "train", "--iterations", "2", "--run", run, "reward=jpeg_compressibility", "algorithm=srpo",
            *tiny_overrides(tiny_checkpoint, wd, **{"sampling.window_size": "null", "sampling.window_range": "null"}),
            "algorithm.reward=clip_score", "reward.weights.clip_score=0.0", f"reward.options.clip_score.path={clip_dir}",
            "algorithm.grid_steps=8", "algorithm.train_window=[1,6]", "algorithm.lr=1e-3"])

    res = train(tmp_path / "ref", "ref")
    assert res.exit_code == 0, res.output + repr(res.exception)
    t = lance.dataset(json.loads(res.stdout.strip().splitlines()[-1])["table_uri"]).to_table()
    assert t.num_rows == 16 and "latents" not in t.column_names and t["final_latent"].null_count == 0
    assert all(json.loads(r)["noise_level"] == 0 for r in t["recipe"].to_pylist())  # ODE rollouts
    assert {d["name"] for d in t["rewards"][0].as_py()} >= {"clip_score", "jpeg_compressibility"}
    (ck,) = (tmp_path / "ref" / "checkpoints" / "ref").glob("*/it_0001")
    weights = load_file(str(ck / "trainable.safetensors"))
    base = load_file(str(tiny_checkpoint / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert any(not torch.equal(weights[k], base[k]) for k in base if k in weights), "no weight moved"
    wd = tmp_path / "A"
    fault_then_resume(monkeypatch, lambda: train(wd, "A"), wd, "A")
    (again,) = (wd / "checkpoints" / "A").glob("*/it_0001")
    resumed = load_file(str(again / "trainable.safetensors"))
    assert all(resumed[k].equal(weights[k]) for k in weights)


def test_misuse_is_refused_before_a_run(tiny_checkpoint, clip_dir, tmp_path):
    algo = build_algorithm(AlgorithmConfig(**SETTINGS))
    with pytest.raises(ValueError, match="algorithm.reward='clip_score' is not one of the run's rewards.*weight 0"):
        algo.check_rewards(RewardSet({"jpeg_compressibility": 1.0}))
    with pytest.raises(ValueError, match="srpo needs a reward it can differentiate.*clip_score, hpsv2, pickscore"):
        build_algorithm(AlgorithmConfig(**{**SETTINGS, "reward": "jpeg_compressibility"})).check_rewards(
            RewardSet({"jpeg_compressibility": 1.0}))
    from pixrl.models.registry import get_family

    with pytest.raises(ValueError, match="glm_image family's decode, and its decode is not differentiable.*qwen_image"):
        algo.check_family(get_family("glm_image"))
    with pytest.raises(ValueError, match="wan family's decode, and its decode is not differentiable"):
        algo.check_family(get_family("wan"))
    with pytest.raises(ValueError, match="sd15 family's decode, and it is not a flow-matching model"):
        algo.check_family(get_family("sd15"))
    with pytest.raises(ValueError, match="train_guidance=3.5: the sd3 family's guidance is cfg"):
        build_algorithm(AlgorithmConfig(**{**SETTINGS, "train_guidance": 3.5})).check_family(get_family("sd3"))
    from pixrl.config.model import ModelConfig

    with pytest.raises(ValueError, match="model.sigmas holds 4 noise levels.*algorithm.grid_steps=4"):
        algo.check_family(get_family("sd3"), ModelConfig(sigmas=[1.0, 0.8, 0.5, 0.2]))
    with pytest.raises(ValueError, match=r"train_window=\(1, 9\)"):
        build_algorithm(AlgorithmConfig(**{**SETTINGS, "train_window": (1, 9)}))
    res = CliRunner().invoke(app, ["train", "--iterations", "1", "algorithm=srpo", "reward=jpeg_compressibility",
                                   *tiny_overrides(tiny_checkpoint, tmp_path / "wd")])
    assert res.exit_code != 0 and "algorithm.reward='hpsv2' is not one of the run's rewards" in res.output, res.output
    assert not (tmp_path / "wd").exists()


@pytest.mark.parametrize("name,guidance,train_guidance", [("flux1", 1.0, 3.5), ("qwen_image", 4.0, None),
                                                          ("sana", 4.5, None)])
def test_its_gradient_reaches_other_families_under_their_guidance(name, guidance, train_guidance, clip_dir,
                                                                  tmp_path):
    """FLUX.1 trained at embedded guidance 3.5 on rollouts at 1 (SRPO's recipe); Qwen-Image's true
    CFG and SANA's CFG with the rollout's negative rows: both terms finite, the velocity's weights
    given a gradient through each family's own differentiable decode."""
    from pixrl.models.registry import get_family

    overrides = get_family(name).write_tiny(tmp_path / name, seed=0)
    fam = get_family(name).load(tmp_path / name, max_sequence_length=overrides["model.max_sequence_length"],
                                resolution=16)
    algo, _ = _bound(clip_dir, train_guidance=train_guidance)
    algo.check_family(type(fam))
    cond = fam.encode_prompts(PROMPTS)
    neg = fam.encode_negative("").select([0] * len(PROMPTS)) if fam.guidance == "cfg" else None
    recipe = SamplerRecipe(4, 0.0, guidance_scale=guidance, train_steps=())
    seeds = [3, 4, 5]
    x0 = sample(fam, cond, neg, generators(seeds), recipe).final
    batch = {"final_latent": x0.numpy(), "seed": np.array(seeds), "prompt": np.array(PROMPTS)}
    policy = ReplayPolicy(fam, None, cond, neg, None, None, recipe, torch.device("cpu"), torch.Generator().manual_seed(1))
    params = [p for p in fam.transformer.parameters() if p.requires_grad]
    losses = []
    for loss, metrics in algo.losses(batch, policy):
        fam.transformer.zero_grad()
        loss.backward()
        losses.append(float(loss))
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
        assert sum(float(p.grad.abs().sum()) for p in params if p.grad is not None) > 0
    if train_guidance is not None:  # the training forward reads its own embedded guidance
        plain, _ = _bound(clip_dir)
        policy.generator.manual_seed(1)
        assert [float(loss) for loss, _ in plain.losses(batch, policy)] != losses
