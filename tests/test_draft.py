"""DRaFT / ReFL / AlignProp (direct reward fine-tuning) on the tiny SD3 checkpoint with a tiny random
CLIP as the differentiable reward: the loss equals the chain written out here — from the stored
x_k, the policy's Euler steps with the gradient on, the clean-estimate jump, the VAE decode, CLIP's
cosine — value and gradient; the update's chain from the stored start reproduces the rollout's
final latent (on policy); ReFL's start steps and hinge, DRaFT-LV's re-noisings; the differentiable
reward paths equal the rewards' own scores; two iterations through the real flow move the weights,
store x_k with a NaN log-prob, `pixrl replay` repeats an update and a fault in update resumes bit
for bit; misuse is refused
before a run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import fault_then_resume, tiny_overrides
from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.replay import ReplayPolicy
from pixrl.algorithms.sampling import generators, sample
from pixrl.cli import app
from pixrl.config.schema import AlgorithmConfig, SamplingConfig
from pixrl.models.sd3 import SD3Family
from pixrl.rewards.clip_tiny import write_tiny_clip
from pixrl.rewards.compose import RewardSet

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]
SEEDS = [3, 4, 5]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return write_tiny_clip(tmp_path_factory.mktemp("clip") / "clip", seed=0, image_size=16)


@pytest.fixture(scope="module")
def family(tiny_checkpoint):
    return SD3Family.load(tiny_checkpoint, max_sequence_length=0)


def _bound(clip_dir, name="draft", **settings):
    algo = build_algorithm(AlgorithmConfig(name=name, reward="clip_score", **settings))
    rewards = RewardSet({"clip_score": 1.0}, {"clip_score": {"path": str(clip_dir)}})
    algo.check_rewards(rewards)
    algo.bind_rewards(rewards)
    return algo


def _rollout(family, algo, steps=6, guidance=1.0, seed=0):
    sampling = SamplingConfig(steps=steps, guidance_scale=guidance, noise_level=0.7)
    recipe = algo.rollout_recipe(sampling, np.random.default_rng(seed), "denoise", 0)
    cond = family.encode_prompts(PROMPTS)
    traj = sample(family, cond, None, generators(SEEDS), recipe)
    batch = {"stored_steps": np.tile(np.array(traj.stored_steps, np.int32), (3, 1)), "latents": traj.latents.numpy(),
             "final_latent": traj.final.numpy(), "prompt": np.array(PROMPTS)}
    policy = ReplayPolicy(family, None, cond, None, traj.sigmas, traj.timesteps, recipe, torch.device("cpu"),
                          torch.Generator().manual_seed(11))
    return recipe, traj, batch, policy


def _reference_loss(family, clip_dir, x, k, n, sigmas, timesteps, cond, scale=1.0, hinge=None):
    """DRaFT's chain written out: Euler steps x + (σ' − σ)·v, the jump x − σ·v, the VAE decode,
    CLIP's L2-normalised image and text features and their cosine; −mean r (or the hinge)."""
    from transformers import CLIPModel, CLIPProcessor

    for j in range(k, k + n):
        v = family.velocity(x, timesteps[j:j + 1], cond, 1.0, None).float()
        x = x - sigmas[j] * v if j == k + n - 1 else x + (sigmas[j + 1] - sigmas[j]) * v
    vae = family.vae
    img = vae.decode(x / vae.config.scaling_factor + (vae.config.get("shift_factor") or 0.0), return_dict=False)[0]
    pixels = (img / 2 + 0.5).clamp(0, 1)
    model = CLIPModel.from_pretrained(str(clip_dir)).eval().requires_grad_(False)
    proc = CLIPProcessor.from_pretrained(str(clip_dir)).image_processor
    mean, std = torch.tensor(proc.image_mean).view(1, 3, 1, 1), torch.tensor(proc.image_std).view(1, 3, 1, 1)
    e = model.get_image_features(pixel_values=(pixels - mean) / std)
    e = torch.nn.functional.normalize(getattr(e, "pooler_output", e), dim=-1)
    tok = CLIPProcessor.from_pretrained(str(clip_dir)).tokenizer(PROMPTS, padding=True, return_tensors="pt")
    t = model.get_text_features(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"])
    r = (e * torch.nn.functional.normalize(getattr(t, "pooler_output", t), dim=-1)).sum(-1)
    return scale * (torch.relu(hinge - r).mean() if hinge is not None else -r.mean())


@pytest.mark.parametrize("settings,k,n", [({"grad_steps": 2}, 4, 2),
                                          ({"start_fraction": (0.5, 0.51), "grad_steps": 2, "objective": "hinge",
                                            "threshold": 0.5, "reward_scale": 0.1}, 3, 2)])
def test_the_loss_is_the_chain_from_the_stored_start_through_decode_and_reward(family, clip_dir, settings, k, n):
    algo = _bound(clip_dir, **settings)
    recipe, traj, batch, policy = _rollout(family, algo)
    assert recipe.train_steps == (k,) and recipe.noise_level == 0 and traj.stored_steps == [k]
    assert torch.isnan(traj.log_probs).all()  # a deterministic step has no density
    params = [p for p in family.transformer.parameters() if p.requires_grad]
    ((loss, metrics),) = list(algo.losses(batch, policy))
    family.transformer.zero_grad()
    loss.backward()
    grads = [p.grad.clone() for p in params]
    assert float(metrics["draft/start_step"]) == k and float(metrics["draft/grad_steps"]) == n
    family.transformer.zero_grad()
    want = _reference_loss(family, clip_dir, traj.latents[:, 0].clone(), k, n, traj.sigmas, traj.timesteps,
                           policy.cond, settings.get("reward_scale", 1.0),
                           settings.get("threshold") if settings.get("objective") == "hinge" else None)
    want.backward()
    assert abs(float(loss.detach()) - float(want.detach())) < 1e-6
    assert all(torch.allclose(g, p.grad, atol=1e-8, rtol=1e-4) for g, p in zip(grads, params))
    assert sum(float(g.abs().sum()) for g in grads) > 0  # the reward's gradient reached the velocity
    family.transformer.zero_grad()


def test_the_chain_from_the_stored_start_reproduces_the_rollout_on_policy(family, clip_dir):
    """Through the last K steps to the end, the update's forward is the rollout's own path: the
    clean estimate equals the stored final latent (CFG included)."""
    from pixrl.algorithms.draft import clean_estimate

    algo = _bound(clip_dir, grad_steps=3)
    recipe = algo.rollout_recipe(SamplingConfig(steps=6, guidance_scale=3.0), np.random.default_rng(0), "denoise", 0)
    cond, neg = family.encode_prompts(PROMPTS), family.encode_negative("").select([0] * 3)
    traj = sample(family, cond, neg, generators(SEEDS), recipe)
    policy = ReplayPolicy(family, None, cond, neg, traj.sigmas, traj.timesteps, recipe, torch.device("cpu"))
    with torch.no_grad():
        x = clean_estimate(policy, traj.latents[:, 0].float(), 3, 3)
    assert torch.allclose(x, traj.final, atol=1e-5), float((x - traj.final).abs().max())


def test_on_a_ddpm_family_the_jump_is_ddims_predicted_clean_latent(tiny_sd15, clip_dir):
    """DRaFT's and ReFL's home, Stable Diffusion 1.x: stepped as its equivalent flow, the stored
    flow latent's jump x − σ·v is DDIMScheduler.step's pred_original_sample of the same UNet output
    (what ReFL.py decodes), and the reward's gradient reaches the UNet through it."""
    from copy import deepcopy

    from pixrl.algorithms.draft import clean_estimate
    from pixrl.algorithms.sampling import vp_scale
    from pixrl.models.sd15 import SD15Family

    fam = SD15Family.load(tiny_sd15[0], resolution=tiny_sd15[1]["model.resolution"])
    algo = _bound(clip_dir, name="refl", start_fraction=(0.5, 0.51))
    algo.check_family(fam)
    recipe = algo.rollout_recipe(SamplingConfig(steps=4), np.random.default_rng(0), "denoise", 0)
    cond = fam.encode_prompts(PROMPTS)
    traj = sample(fam, cond, None, generators(SEEDS), recipe)
    (k,) = recipe.train_steps
    policy = ReplayPolicy(fam, None, cond, None, traj.sigmas, traj.timesteps, recipe, torch.device("cpu"))
    with torch.no_grad():
        got = clean_estimate(policy, traj.latents[:, 0].float(), k, 1)
        sched = deepcopy(fam.ddim)
        sched.set_timesteps(4)
        t = sched.timesteps[k]
        x_t = traj.latents[:, 0] / vp_scale(fam, traj.sigmas[k])
        eps = fam.unet_output(x_t, t.reshape(1).expand(3), cond)
        want = sched.step(eps, t, x_t).pred_original_sample
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    batch = {"stored_steps": np.full((3, 1), k, np.int32), "latents": traj.latents.numpy(),
             "final_latent": traj.final.numpy(), "prompt": np.array(PROMPTS)}
    ((loss, _),) = list(algo.losses(batch, policy))
    loss.backward()
    assert sum(float(p.grad.abs().sum()) for p in fam.transformer.parameters() if p.grad is not None) > 0


def test_refl_draws_its_start_in_the_last_quarter_and_alignprop_its_depth(clip_dir):
    refl = build_algorithm(AlgorithmConfig(name="refl"))
    s = refl.settings
    assert (s.reward, s.start_fraction, s.objective, s.threshold, s.reward_scale, s.grad_steps) == (
        "imagereward", (0.75, 1.0), "hinge", 2.0, 1e-3, 1)
    sampling = SamplingConfig(steps=40, noise_level=0.7)
    starts = {refl.rollout_recipe(sampling, np.random.default_rng(i), "denoise", i).train_steps for i in range(200)}
    assert starts == {(k,) for k in range(30, 40)}  # ReFL.py's randint(30, 39)
    assert {refl.grad_steps_from(k, 40) for (k,) in starts} == {1}
    align = build_algorithm(AlgorithmConfig(name="draft", grad_steps_range=(1, 4)))
    depths = {40 - align.rollout_recipe(sampling, np.random.default_rng(i), "denoise", i).train_steps[0]
              for i in range(100)}
    assert depths == {1, 2, 3, 4} and align.grad_steps_from(37, 40) == 3  # to the end
    draft = build_algorithm(AlgorithmConfig(name="draft", grad_steps=2))
    assert draft.rollout_recipe(sampling, np.random.default_rng(0), "denoise", 0).train_steps == (38,)


def test_lv_renoises_the_final_latent_with_the_updates_generator(family, clip_dir):
    algo = _bound(clip_dir, lv_samples=2)
    _, traj, batch, policy = _rollout(family, algo)
    assert algo.terms(batch) == 2 and traj.stored_steps == [5]
    terms = list(algo.losses(batch, policy))
    assert len(terms) == 2 and float(terms[0][0]) != float(terms[1][0])
    policy.generator.manual_seed(11)
    again = [float(loss) for loss, _ in algo.losses(batch, policy)]
    assert again == [float(loss) for loss, _ in terms]  # the update's seeded draws: replayable
    gen = torch.Generator().manual_seed(11)
    x0, sigma = traj.final.float(), float(traj.sigmas[5])
    eps = torch.randn(x0.shape, generator=gen)
    want = _reference_loss(family, clip_dir, sigma * eps + (1 - sigma) * x0, 5, 1, traj.sigmas, traj.timesteps,
                           policy.cond)
    assert abs(float(want) - again[0]) < 1e-6


def test_two_iterations_train_and_a_fault_in_update_resumes_bit_for_bit(tiny_checkpoint, clip_dir, tmp_path,
                                                                      monkeypatch, prefect_harness):
    import lance
    from safetensors.torch import load_file

    def train(wd, run):
        return CliRunner().invoke(app, [
            "train", "--iterations", "2", "--run", run, "reward=jpeg_compressibility", "algorithm=alignprop",
            *tiny_overrides(tiny_checkpoint, wd, **{"sampling.window_size": "null", "sampling.window_range": "null"}),
            "algorithm.reward=clip_score", "reward.weights.clip_score=0.0", f"reward.options.clip_score.path={clip_dir}",
            "algorithm.grad_steps_range=[1,3]", "algorithm.lr=1e-3"])

    res = train(tmp_path / "ref", "ref")
    assert res.exit_code == 0, res.output + repr(res.exception)
    t = lance.dataset(json.loads(res.stdout.strip().splitlines()[-1])["table_uri"]).to_table()
    assert t.num_rows == 16 and t["latents"].null_count == 0 and t["final_latent"].null_count == 0
    recipes = [json.loads(r) for r in t["recipe"].to_pylist()]
    assert all(r["noise_level"] == 0 and len(r["train_steps"]) == 1 for r in recipes)  # ODE, one stored start
    assert [s[0] for s in t["stored_steps"].to_pylist()] == [r["train_steps"][0] for r in recipes]
    assert all(1 <= 4 - r["train_steps"][0] <= 3 for r in recipes)
    assert np.isnan(np.array(t["log_probs"].to_pylist(), dtype=np.float32)).all()
    first, last = (load_file(str(ck / "trainable.safetensors"))
                   for ck in sorted((tmp_path / "ref" / "checkpoints" / "ref").glob("*/it_*")))
    assert first and all("lora" in k for k in first)  # the preset's LoRA adapter
    assert any(not torch.equal(first[k], last[k]) for k in first), "the update changed no adapter weight"
    weights = last
    rep = CliRunner().invoke(app, ["replay", "ref", "--iteration", "1", "--workdir", str(tmp_path / "ref")])
    assert rep.exit_code == 0 and json.loads(rep.stdout.strip().splitlines()[-1])["equal"] is True, rep.output
    wd = tmp_path / "A"
    fault_then_resume(monkeypatch, lambda: train(wd, "A"), wd, "A")
    (again,) = (wd / "checkpoints" / "A").glob("*/it_0001")
    resumed = load_file(str(again / "trainable.safetensors"))
    assert all(resumed[k].equal(weights[k]) for k in weights)


def test_misuse_is_refused_before_a_run(tiny_checkpoint, clip_dir, tmp_path):
    from pixrl.models.registry import get_family

    algo = build_algorithm(AlgorithmConfig(name="draft", reward="clip_score"))
    with pytest.raises(ValueError, match="algorithm.reward='clip_score' is not one of the run's rewards.*weight 0"):
        algo.check_rewards(RewardSet({"jpeg_compressibility": 1.0}))
    with pytest.raises(ValueError, match="draft needs a reward it can differentiate.*aesthetic, clip_score, hpsv2, "
                                         "imagereward, pickscore"):
        build_algorithm(AlgorithmConfig(name="draft", reward="jpeg_compressibility")).check_rewards(
            RewardSet({"jpeg_compressibility": 1.0}))
    with pytest.raises(ValueError, match="wan family's decode, and its decode is not differentiable"):
        algo.check_family(get_family("wan"))
    with pytest.raises(ValueError, match="refl.*hunyuan_image family's decode, and its guider's phases.*pixart_sigma"):
        build_algorithm(AlgorithmConfig(name="refl")).check_family(get_family("hunyuan_image"))
    with pytest.raises(ValueError, match=r"grad_steps=12\) do not fit sampling.steps=10"):
        build_algorithm(AlgorithmConfig(name="draft", grad_steps=12)).check_sampling(SamplingConfig(steps=10), "denoise")
    with pytest.raises(ValueError, match="max_rounds=1"):
        algo.check_sampling(SamplingConfig(max_rounds=2, steps=10), "denoise")
    for bad, msg in [({"grad_steps_range": (1, 3), "start_fraction": (0.5, 1.0)}, "set one"),
                     ({"lv_samples": 2, "grad_steps": 2}, "takes grad_steps=1"),
                     ({"start_fraction": (0.9, 0.5)}, "0 ≤ a < b ≤ 1"), ({"grad_steps_range": (3, 2)}, "lo ≤ hi")]:
        with pytest.raises(Exception, match=msg):
            build_algorithm(AlgorithmConfig(name="draft", **bad))
    res = CliRunner().invoke(app, ["train", "--iterations", "1", "algorithm=refl", "reward=jpeg_compressibility",
                                   *tiny_overrides(tiny_checkpoint, tmp_path / "wd")])
    assert res.exit_code != 0 and "algorithm.reward='imagereward' is not one of the run's rewards" in res.output, \
        res.output
    assert not (tmp_path / "wd").exists()
