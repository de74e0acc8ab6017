"""Two-expert Wan2.2 (the T2V-A14B layout: `transformer` for t ≥ boundary_ratio·T, `transformer_2`
below, each with its CFG scale) on a tiny random checkpoint in the real diffusers layout: ODE
sampling equals diffusers' WanPipeline whichever expert is trained, a replay batch that mixes the
experts' steps equals its rows one by one, stored log-probs replay exactly across the switch, the
errors that name model.expert, and two RL iterations that train only the chosen expert."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import two_iterations
from family_checks import assert_replay_is_on_policy, euler, gens
from pixrl.algorithms.sampling import SamplerRecipe, replay_step, sample
from pixrl.config.loader import load_config
from pixrl.models.base import ModelLoadError
from pixrl.models.wan import WanFamily
from pixrl.stages.preflight import PreflightError, preflight

PROMPTS = ["a red circle", "two blue squares in the sky"]


@pytest.fixture(scope="module")
def tiny_a14b(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny-wan22-a14b"
    overrides = WanFamily.write_tiny(out, seed=3, two_experts=True)
    return out, overrides


def _load(path, expert: str, guidance_scale_2: float | None = 3.0) -> WanFamily:
    return WanFamily.load(path, max_sequence_length=64, resolution=32, frames=5, expert=expert,
                          **({} if guidance_scale_2 is None else {"guidance_scale_2": guidance_scale_2}))


@pytest.mark.parametrize("expert", ["high", "low"])
@pytest.mark.parametrize("cfg,cfg2", [(5.0, 3.0), (4.0, None), (1.0, None)])
def test_ode_sampling_equals_the_two_expert_pipeline(tiny_a14b, expert, cfg, cfg2):
    family = _load(tiny_a14b[0], expert, cfg2)
    assert family.boundary == 875.0 and family.describe()["expert"] == expert
    trained = family.pipe.transformer if expert == "high" else family.pipe.transformer_2
    assert family.trainable_module() is trained and family.frozen_expert is not trained
    cond = family.encode_prompts(PROMPTS)
    neg = family.encode_negative("").expand(2) if cfg > 1 else None
    with euler(family):
        ref = family.pipe(prompt_embeds=cond.prompt_embeds, negative_prompt_embeds=None if neg is None else neg.prompt_embeds,
                          guidance_scale=cfg, guidance_scale_2=cfg2, num_inference_steps=6, generator=gens([7, 8]),
                          output_type="latent", height=32, width=32, num_frames=5, max_sequence_length=64).frames
        _, timesteps = family.schedule(6)
        traj = sample(family, cond, neg, gens([7, 8]), SamplerRecipe(6, 0.0, guidance_scale=cfg, train_steps=()))
    assert (timesteps >= 875).any() and (timesteps < 875).any()  # both experts denoise
    assert (traj.final - ref).abs().max().item() <= 1e-5


def test_a_batch_mixing_the_experts_steps_equals_its_rows_one_by_one(tiny_a14b):
    family = _load(tiny_a14b[0], "low")
    cond, neg = family.encode_prompts(PROMPTS * 2), family.encode_negative("").expand(4)
    x = torch.randn(4, *family.latent_shape(), generator=torch.Generator().manual_seed(0))
    t = torch.tensor([999.0, 600.0, 937.0, 376.0])  # high, low, high, low
    with torch.no_grad():
        mixed = family.velocity(x, t, cond, 5.0, neg)
        by_expert = {rows: family.velocity(x[list(rows)], t[list(rows)], cond.select(list(rows)), 5.0,
                                           neg.select(list(rows))) for rows in ((0, 2), (1, 3))}
        high = family._guided(family.frozen_expert, x[[0, 2]], t[[0, 2]], cond.select([0, 2]), neg.select([0, 2]), 5.0)
        low_at_5 = family._guided(family.transformer, x[[1, 3]], t[[1, 3]], cond.select([1, 3]), neg.select([1, 3]),
                                  5.0)
    assert torch.equal(mixed[[0, 2]], by_expert[(0, 2)]) and torch.equal(mixed[[1, 3]], by_expert[(1, 3)])
    assert torch.equal(by_expert[(0, 2)], high)  # t ≥ 875: the (frozen) high-noise expert, at guidance_scale
    assert not torch.allclose(by_expert[(1, 3)], low_at_5, atol=1e-4)  # below: the trained one, at guidance_scale_2
    assert torch.allclose(by_expert[(1, 3)], family._guided(family.transformer, x[[1, 3]], t[[1, 3]],
                                                            cond.select([1, 3]), neg.select([1, 3]), 5.0, 3.0))


@pytest.mark.parametrize("expert", ["high", "low"])
def test_replay_is_on_policy_across_the_switch(tiny_a14b, expert):
    """SDE at steps on both sides of the boundary (t = 999, 900 | 750, 500): every stored log-prob
    replays exactly (ratio 1); the trained expert's steps carry a gradient, the frozen one's none."""
    family = _load(tiny_a14b[0], expert)
    cond, neg = family.encode_prompts(PROMPTS), family.encode_negative("").expand(2)
    recipe = SamplerRecipe(steps=4, noise_level=0.7, guidance_scale=5.0, train_steps=(0, 1, 2))
    traj = sample(family, cond, neg, gens([0, 1]), recipe)
    for j, k in enumerate(traj.stored_steps):
        out = replay_step(family, traj.latents[:, j], traj.next_latents[:, j], k, traj.sigmas, traj.timesteps,
                          cond, neg, recipe)
        assert torch.equal(out.log_prob.detach(), traj.log_probs[:, j])
        assert out.log_prob.requires_grad == ((traj.timesteps[k] >= 875).item() == (expert == "high")), k
    window = (0, 1) if expert == "high" else (2, 3)
    assert_replay_is_on_policy(family, cond, neg, SamplerRecipe(steps=4, noise_level=0.7, guidance_scale=5.0,
                                                                sde_steps=window, train_steps=window))
    assert all(p.grad is None for p in family.frozen_expert.parameters())


def test_expert_errors_name_the_setting(tiny_a14b, tiny_wan, tiny_flux, tmp_path):
    path, _ = tiny_a14b
    with pytest.raises(ModelLoadError, match="two-expert Wan2.2 checkpoint.*model.expert=high or model.expert=low"):
        WanFamily.load(path, max_sequence_length=64, resolution=32, frames=5)
    with pytest.raises(ModelLoadError, match="model.expert: .* has one transformer"):
        WanFamily.load(tiny_wan[0], max_sequence_length=64, resolution=32, frames=5, expert="high")

    def check(model_path, *overrides):
        cfg = load_config(None, [f"model.path={model_path}", "model.max_sequence_length=64", "model.resolution=32",
                                 f"run.workdir={tmp_path}", *overrides])
        preflight(cfg)

    with pytest.raises(PreflightError, match="two-expert Wan2.2 checkpoint"):
        check(path, "model.family=wan", "model.frames=5")
    with pytest.raises(PreflightError, match="model.expert=low: the flux1 family does not read it"):
        check(tiny_flux[0], "model.family=flux1", "model.expert=low")
    with pytest.raises(PreflightError, match="model.guidance_scale_2=3.0: CFG is off"):
        check(path, "model.family=wan", "model.frames=5", "model.expert=low", "model.guidance_scale_2=3.0",
              "sampling.guidance_scale=1.0")
    low = ["model.family=wan", "model.frames=5", "model.expert=low", "sampling.steps=10", "sampling.window_size=2"]
    with pytest.raises(PreflightError, match=r"window_range=\[0,4\] reaches step\(s\) \[0, 1, 2, 3\] of 10, which the "
                                             r"frozen high-noise expert denoises; model.expert=low denoises steps \[4,"):
        check(path, *low, "sampling.window_range=[0,4]")
    check(path, *low, "sampling.window_range=[4,8]", "model.guidance_scale_2=3.0", "sampling.guidance_scale=4.0")


def test_two_iterations_train_only_the_low_noise_expert(tiny_a14b, tmp_path, prefect_harness):
    """A full fine-tune of transformer_2 with the SDE window on its steps: its weights move, and
    they are transformer_2's (the high-noise expert's differ by far more than the update)."""
    path, overrides = tiny_a14b
    two_iterations((path, {**overrides, "model.expert": "low"}), tmp_path, "a14b-low", "full",
                   "sampling.guidance_scale=5.0", "model.guidance_scale_2=3.0", "sampling.window_size=2",
                   "sampling.window_range=[2,4]", base_weights="transformer_2/diffusion_pytorch_model.safetensors")
    last = load_file(str(sorted((tmp_path / "checkpoints" / "a14b-low").glob("*/it_*"))[-1] / "trainable.safetensors"))
    low = load_file(str(path / "transformer_2" / "diffusion_pytorch_model.safetensors"))
    high = load_file(str(path / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert set(last) == set(low)
    moved = sum((last[k].float() - low[k].float()).norm() for k in last)
    apart = sum((high[k].float() - low[k].float()).norm() for k in last)
    assert 0 < moved < 0.1 * apart


def test_two_iterations_lora_on_the_high_noise_expert(tiny_a14b, tmp_path, prefect_harness):
    path, overrides = tiny_a14b
    two_iterations((path, overrides), tmp_path, "a14b-high", "lora", "sampling.guidance_scale=5.0",
                   "sampling.window_size=2", "sampling.window_range=[0,2]")


def test_an_update_with_every_step_on_the_frozen_expert_names_the_cause(tiny_a14b, tmp_path, prefect_harness,
                                                                          monkeypatch):
    """Past preflight (an algorithm's own recipe could put its window anywhere): the update stops
    with the cause instead of autograd's "does not require grad"."""
    from typer.testing import CliRunner

    from conftest import tiny_overrides
    from pixrl.cli import app

    monkeypatch.setattr(WanFamily, "_check_expert_steps", staticmethod(lambda *a: None))
    path, overrides = tiny_a14b
    extra = {k: v for k, v in overrides.items() if k != "model.path"}
    res = CliRunner().invoke(app, ["train", "--iterations", "1", "--run", "frozen", "reward=jpeg_compressibility",
                                   *tiny_overrides(path, tmp_path, **extra), "sampling.window_range=[2,4]"])
    assert res.exit_code != 0
    assert "no loss term of this optimizer step depends on the trained weights" in res.output + repr(res.exception)


def test_dpo_from_an_archive_trains_the_low_noise_expert_on_its_side(tiny_a14b, tmp_path, prefect_harness,
                                                                      monkeypatch):
    """Offline Diffusion-DPO of transformer_2: σ drawn below the boundary only (every loss term
    reaches the trained weights), the published weights are transformer_2's, moved."""
    import json

    from typer.testing import CliRunner

    from conftest import tiny_overrides
    from pixrl.algorithms import diffusion_dpo
    from pixrl.cli import app

    drawn = []
    noised = diffusion_dpo.noised
    monkeypatch.setattr(diffusion_dpo, "noised", lambda x0, noise, sigma: drawn.append(sigma) or noised(x0, noise, sigma))

    path, overrides = tiny_a14b
    low = {**{k: v for k, v in overrides.items() if k != "model.path"}, "model.expert": "low",
           "sampling.window_range": "[2,4]"}
    res = CliRunner().invoke(app, ["rollouts", "-n", "1", "--run", "src", "reward=jpeg_compressibility",
                                   *tiny_overrides(path, tmp_path, **low)])
    assert res.exit_code == 0, res.output
    model = [f"{k}={v}" for k, v in low.items() if k.startswith("model.")]
    res = CliRunner().invoke(app, ["dpo", "--from", "src", "-n", "2", "--run", "dpo-low", "--workdir", str(tmp_path),
                                   f"model.path={path}", *model, "dpo.pairs_per_step=2", "sampling.eval_steps=2",
                                   "dpo.eval_per_category=1"])
    assert res.exit_code == 0, res.output
    source = json.loads(res.stdout.strip().splitlines()[-1])["policy"]["source"].removeprefix("file://")
    trained = load_file(f"{source}/trainable.safetensors")
    base = load_file(str(path / "transformer_2" / "diffusion_pytorch_model.safetensors"))
    assert set(trained) == set(base) and any(not torch.equal(trained[k], base[k]) for k in base)
    sigmas = torch.cat(drawn)
    assert len(sigmas) >= 4 and float(sigmas.max()) < 0.875  # the (shifted) σ the loss saw: the low expert's side


def test_fsdp_of_the_low_noise_expert_equals_one_process():
    """Two gloo ranks (rank 1 builds transformer_2 on the meta device and receives rank 0's
    weights) against one process: three optimizer steps of a full fine-tune with a KL reference."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from fsdp_families import check

    threads = torch.get_num_threads()
    try:
        assert check("wan_a14b") < 1e-5
    finally:  # the check's one-process update runs here at 1 thread
        torch.set_num_threads(threads)


def test_pixrl_tiny_writes_the_two_expert_layout(tmp_path):
    import json

    from typer.testing import CliRunner

    from pixrl.cli import app

    res = CliRunner().invoke(app, ["tiny", "wan", "--two-experts", "--out", str(tmp_path / "a14b")])
    assert res.exit_code == 0, res.output
    overrides = json.loads(res.stdout.strip().splitlines()[-1])
    index = json.loads((tmp_path / "a14b" / "model_index.json").read_text())
    assert index["transformer_2"] == ["diffusers", "WanTransformer3DModel"] and index["boundary_ratio"] == 0.875
    assert overrides["model.expert"] == "high" and overrides["sampling.window_range"] == "[0,2]"
    res = CliRunner().invoke(app, ["tiny", "flux1", "--two-experts", "--out", str(tmp_path / "f")])
    assert res.exit_code != 0 and "the flux1 family has no two-expert layout" in res.output
    assert not (tmp_path / "f").exists()


def test_a_checkpoint_of_the_other_expert_is_refused(tiny_a14b, tmp_path):
    """Both experts' tensors have the same names and shapes: the checkpoint's config says which
    expert it trained, and a policy of the other refuses it instead of loading it unnoticed."""
    from pixrl.artifacts.checkpoints import save_checkpoint
    from pixrl.engines.policy import TrainablePolicy

    path, overrides = tiny_a14b
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()] + [f"run.workdir={tmp_path}"])
    high = TrainablePolicy(cfg)
    low_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"expert": "low"})})
    low = TrainablePolicy(low_cfg)
    ck = save_checkpoint(tmp_path / "ck-high", high.state(), {}, {"iteration": 0}, cfg.model_dump(mode="json"))
    with pytest.raises(ValueError, match="trained as model.expert=high; this policy trains model.expert=low"):
        low.load_version(Path(ck.uri))
    high.load_version(Path(ck.uri))  # its own expert loads
    assert high.weights_id == ck.checkpoint_id


@pytest.mark.parametrize("algorithm", ["flow_grpo", "dance_grpo", "diffusion_nft"])
def test_algorithms_train_and_count_only_the_trained_experts_steps(tiny_a14b, tmp_path, algorithm):
    """Every-step SDE over both experts' steps (t = 999, 900 | 750, 500 for 4 steps): the low-noise
    expert's update replays and counts only its steps — Flow-GRPO its stored transitions there,
    DanceGRPO and DiffusionNFT draw among them — so every term has a gradient and the averaging
    divisor counts only trained terms; a one-transformer model trains every step as before."""
    import numpy as np

    from pixrl.algorithms.replay import trained_grid_steps
    from pixrl.engines.base import PolicySource
    from pixrl.engines.local import LocalEngine
    from pixrl.engines.update import ReplayFactory

    path, overrides = tiny_a14b
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()]
                      + [f"run.workdir={tmp_path}", "model.expert=low", f"algorithm={algorithm}",
                         "sampling.window_size=null", "algorithm.lora.enabled=false"])
    engine = LocalEngine(cfg)
    recipe = SamplerRecipe(steps=4, noise_level=0.7, guidance_scale=1.0, train_steps=(0, 1, 2))
    prompts = PROMPTS * 2
    batch, _ = engine.rollout(PolicySource(), prompts, [0, 1, 2, 3], recipe)
    batch = batch.with_columns(prompt=prompts, advantage=np.array([1.0, -1.0, 0.5, -0.5], np.float32))
    fam, algo = engine.policy.family, engine.algorithm
    timesteps = torch.from_numpy(batch["timesteps"][0].copy())
    low = frozenset(k for k in range(4) if float(timesteps[k]) < 875)
    assert trained_grid_steps(fam, timesteps) == low and 0 < len(low) < 4
    assert fam.trains_timesteps(timesteps).tolist() == [k in low for k in range(4)]
    replay = ReplayFactory(engine.policy, engine._prompts, algo, batch, recipe, None)
    assert replay.trained_steps == low
    seen = []
    velocity = fam.velocity
    fam.velocity = lambda x, t, *a, **k: seen.append(t.detach().reshape(-1).clone()) or velocity(x, t, *a, **k)
    terms = list(algo.losses(batch, replay(list(range(4)), torch.Generator().manual_seed(0))))
    count = getattr(algo, "_count", None)
    want = {"flow_grpo": lambda: len(low & {0, 1, 2}), "dance_grpo": lambda: count(len(low & {0, 1, 2})),
            "diffusion_nft": lambda: count(len(low))}[algorithm]()
    assert len(terms) == algo.terms(batch, replay.trained_steps) == want
    assert all(loss.requires_grad for loss, _ in terms)
    assert seen and all(float(t.max()) < 875 for t in seen)  # the trained model ran only the low expert's steps
    every = {"flow_grpo": lambda: 3, "dance_grpo": lambda: count(3), "diffusion_nft": lambda: count(4)}[algorithm]()
    assert algo.terms(batch) == every  # no trained-step set: every stored step, every grid step
