"""The seeds' algorithms — DanceGRPO, MixGRPO (+Flash), GRPO-Guard, Flow-DPPO, DiffusionNFT —
against the formulas of ../shared/reference/algorithms.md §3–§8, their samplers' rollout →
replay ratio, and each through the real flow with a fault in update and a bit-identical resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pixrl.algorithms.advantages import unbiased_group_advantages
from pixrl.algorithms.diffusion_nft import nft_policy_loss, optimality, return_decay
from pixrl.algorithms.flow_dppo import dppo_mask
from pixrl.algorithms.flow_sde import flow_step
from pixrl.algorithms.grpo_guard import normalised_log_ratio
from pixrl.algorithms.ode_solvers import compressed_tail, dpm_step, shifted
from pixrl.algorithms.step_schedules import mix_window, random_sde_steps


# --- DanceGRPO ------------------------------------------------------------------------------------
def test_dance_step_is_dancegrpo_flux_step():
    """flux_step (train_grpo_flux.py L131), written out literally: μ from the score form, std η·sqrt(δt)."""
    g = torch.Generator().manual_seed(0)
    x, v, eps = (torch.randn(3, 4, 5, 5, generator=g) for _ in range(3))
    eta = 0.3
    for sigma, nxt in ((1.0, 0.9), (0.6, 0.45), (0.2, 0.1)):
        out = flow_step(v, x, torch.tensor(sigma), torch.tensor(nxt), 0.95, eta, "dance", noise=eps)
        dsigma = nxt - sigma
        mean = x + dsigma * v
        x0 = x - sigma * v
        score = -(x - (1 - sigma) * x0) / sigma**2
        mean = mean + (-0.5 * eta**2 * score) * dsigma
        std = eta * math.sqrt(-dsigma)
        x_next = mean + std * eps
        lp = (-((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))
        assert torch.allclose(out.mean, mean, atol=1e-6) and torch.allclose(out.prev_sample, x_next, atol=1e-6)
        assert torch.allclose(out.std, torch.full((3,), std)) and torch.allclose(out.log_prob, lp, atol=1e-5)
        # Dance-SDE ≡ Flow-SDE with s_t ≡ η: the Flow-GRPO drift with that coefficient
        flow_mean = x * (1 + eta**2 / (2 * sigma) * dsigma) + v * (1 + eta**2 * (1 - sigma) / (2 * sigma)) * dsigma
        assert torch.allclose(out.mean, flow_mean, atol=1e-6)


def test_unbiased_group_advantages():
    r = np.array([1.0, 0.0, 0.5, 0.5, 0.2, 0.2])
    g = np.array([0, 0, 0, 1, 1, 1])
    a = unbiased_group_advantages(r, g)
    r0 = r[:3]
    assert np.allclose(a.advantages[:3], (r0 - r0.mean()) / (r0.std(ddof=1) + 1e-8), atol=1e-6)
    r1 = r[3:]
    assert np.allclose(a.advantages[3:], (r1 - r1.mean()) / (r1.std(ddof=1) + 1e-8), atol=1e-5)
    flat = unbiased_group_advantages(np.ones(4), np.array([0, 0, 1, 1]))
    assert flat.zero_std_ratio == 1.0 and not flat.advantages.any()


def test_dance_best_of_n_trains_each_groups_extremes():
    """train_grpo_hunyuan.py's best-of-N, written out: argsort of a group's advantages, its last
    and first bestofn/2 kept; the others do not enter the update."""
    import torch as t

    from pixrl.algorithms.base import build_algorithm
    from pixrl.config.loader import load_config
    from pixrl.stages.preflight import PreflightError, preflight

    rng = np.random.default_rng(0)
    r, g = rng.normal(size=24 * 2), np.repeat([3, 7], 24)
    algo = build_algorithm(load_config("shapes_dance_grpo", ["algorithm.best_of=8"]).algorithm)
    adv = algo.advantages(r, g).advantages
    keep = algo.trains_on(adv, g)
    for grp in (3, 7):
        scores = t.tensor(adv[g == grp])
        order = t.argsort(scores)
        want = np.zeros(24, dtype=bool)
        want[t.cat([order[-4:], order[:4]]).numpy()] = True
        assert keep[g == grp].tolist() == want.tolist()
    assert keep.sum() == 16
    plain = build_algorithm(load_config("shapes_dance_grpo").algorithm)
    assert plain.trains_on(adv, g).all()
    with pytest.raises(PreflightError, match="best_of=32.*group_size=16"):
        preflight(load_config("shapes_dance_grpo", ["algorithm.best_of=32"]))


# --- MixGRPO --------------------------------------------------------------------------------------
def test_mix_window_progressive_schedule_follows_grpo_training_states():
    """T = 10 (max_t 8), W = 4, 2 iterations per window, stride 1, roll back: upstream's sequence,
    except that the empty window upstream gives at iterations 16–17 is the roll-back here."""
    want = [(0, 1, 2, 3)] * 2 + [(1, 2, 3, 4)] * 2 + [(2, 3, 4, 5)] * 2 + [(3, 4, 5, 6)] * 2 + \
        [(4, 5, 6, 7)] * 2 + [(5, 6, 7)] * 2 + [(6, 7)] * 2 + [(7,)] * 2 + [(0, 1, 2, 3)] * 2 + [(1, 2, 3, 4)]
    got = [mix_window(i, 10, 4, 2, 1, True) for i in range(len(want))]
    assert got == want
    assert all(mix_window(i, 10, 4, 20, 0) == (0, 1, 2, 3) for i in range(0, 200, 7))  # Flash*: frozen
    assert mix_window(100, 10, 4, 2, 1, roll_back=False) == (7,)  # stays at the last non-empty window
    assert [mix_window(i, 10, 4, 1, 4, True) for i in range(3)] == [(0, 1, 2, 3), (4, 5, 6, 7), (0, 1, 2, 3)]
    rng = np.random.default_rng(0)
    for _ in range(20):
        w = mix_window(0, 10, 4, 1, 1, strategy="random", rng=rng)
        assert len(w) == 4 and w[0] >= 0 and w[-1] <= 7


def _grid(steps: int, shift: float) -> torch.Tensor:
    return shifted(torch.linspace(1, 0, steps + 1, dtype=torch.float64), shift).float()


def test_flash_tail_grid_matches_mixgrpo_post_schedule():
    """T = 25, shift 3, last SDE step 3, ratio 0.4 → 8 points from σ[4] (MixGRPO's post_sigma_schedule)."""
    tail = compressed_tail(_grid(25, 3.0), 3, 0.4, 3.0)
    want = [0.9403, 0.8852, 0.8182, 0.7347, 0.6279, 0.4865, 0.2903, 0.0]
    assert torch.allclose(tail, torch.tensor(want), atol=1e-4)
    assert len(compressed_tail(_grid(25, 3.0), 3, 0.2, 3.0)) == 4
    assert len(compressed_tail(_grid(25, 3.0), 21, 0.4, 3.0)) == 2  # upstream's 1 point would stop at σ > 0


def _dpm_reference(velocity, x, sigmas, x0_history=None):
    """diffusers' DPMSolverMultistepScheduler (dpmsolver++, order 2, midpoint, flow sigmas) on `sigmas`,
    optionally continuing a history (the x̂0 at the σ before sigmas[0])."""
    from diffusers import DPMSolverMultistepScheduler

    sched = DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint",
                                        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                        lower_order_final=True, final_sigmas_type="zero")
    n = len(sigmas) - 1
    sched.set_timesteps(n)
    start = 0
    if x0_history is not None:
        prev_sigma, prev_x0 = x0_history
        sigmas = torch.cat([torch.tensor([prev_sigma]), sigmas])
        sched.model_outputs = [None, prev_x0]
        sched.lower_order_nums = 1
        start = 1
    sched.sigmas = sigmas.float()
    sched.timesteps = (sigmas[:-1] * 1000).long()
    sched.num_inference_steps = len(sched.timesteps)
    sched._step_index = start
    for i in range(start, len(sigmas) - 1):
        v = velocity(x, float(sigmas[i]))
        x = sched.step(v, sched.timesteps[i], x, return_dict=False)[0]
    return x


def _velocity(x, sigma):
    return 0.7 * x * (1 + sigma) - 0.3 * torch.tanh(x) + sigma


def test_dpm_solver_equals_diffusers_dpm_solver_pp_2m():
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1))
    sched_sigmas = _grid(10, 3.0)
    sched_sigmas[0] = 0.997  # diffusers' flow sigmas stop short of 1
    ours, prev_x0, prev_sigma = x.clone(), None, None
    for i in range(10):
        s, sn = float(sched_sigmas[i]), float(sched_sigmas[i + 1])
        ours, x0 = dpm_step(ours, _velocity(ours, s), s, sn, prev_x0, prev_sigma)
        prev_x0, prev_sigma = x0, s
    ref = _dpm_reference(_velocity, x.clone(), sched_sigmas)
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()

    # the Flash tail: continuing the data-prediction history of the window's last step
    tail = compressed_tail(_grid(10, 3.0), 3, 0.5, 3.0)
    hist_sigma = float(_grid(10, 3.0)[3])
    hist_x0 = x - hist_sigma * _velocity(x, hist_sigma)
    ours, prev_x0, prev_sigma = x.clone(), hist_x0, hist_sigma
    for i in range(len(tail) - 1):
        s, sn = float(tail[i]), float(tail[i + 1])
        ours, x0 = dpm_step(ours, _velocity(ours, s), s, sn, prev_x0, prev_sigma)
        prev_x0, prev_sigma = x0, s
    ref = _dpm_reference(_velocity, x.clone(), tail, (hist_sigma, hist_x0))
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


# --- GRPO-Guard -------------------------------------------------------------------------------------
def test_grpo_guard_normalised_ratio_identity():
    """x' = μ_old + s·ε ⇒ log ρ̃ = mean_CHW(ε ⊙ (μ_θ − μ_old)); θ = old ⇒ ρ̃ = 1 exactly."""
    g = torch.Generator().manual_seed(2)
    x, v, eps = (torch.randn(4, 4, 5, 5, generator=g) for _ in range(3))
    v_new = v + 0.05 * torch.randn(4, 4, 5, 5, generator=g)
    sigma, nxt, a = torch.tensor(0.7), torch.tensor(0.6), 0.7
    old = flow_step(v, x, sigma, nxt, 0.95, a, noise=eps)
    new = flow_step(v_new, x, sigma, nxt, 0.95, a, prev_sample=old.prev_sample)
    s = new.std_dev_t.mean() * torch.sqrt(sigma - nxt)
    log_r = normalised_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, s)
    want = (eps * (new.mean - old.mean)).mean(dim=(1, 2, 3))
    assert torch.allclose(log_r, want, atol=1e-5)
    same = flow_step(v, x, sigma, nxt, 0.95, a, prev_sample=old.prev_sample)
    assert torch.equal(torch.exp(normalised_log_ratio(same.log_prob, old.log_prob, same.mean, old.mean, s)),
                       torch.ones(4))


# --- Flow-DPPO --------------------------------------------------------------------------------------
def test_flow_dppo_mask_truth_table():
    tau = 1e-5
    kl = torch.tensor([1e-6, 1e-6, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4])
    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5, 0.5, 1.5, float("inf"), 1.0])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, 1.0])
    keep, pos, neg = dppo_mask(kl, ratio, adv, tau)
    # below τ: kept; above τ: dropped when the move follows the advantage, kept when corrective
    assert keep.tolist() == [True, True, False, False, True, True, False, True]
    assert pos.tolist() == [False, False, True, False, False, False, True, False]
    assert neg.tolist() == [False, False, False, True, False, False, False, False]
    loss = torch.where(keep, -adv * ratio, torch.zeros_like(ratio)).mean()
    assert torch.isfinite(loss)  # ρ = inf is masked without producing NaN


def test_flow_dppo_steps_are_distinct_and_from_the_pool():
    rng = np.random.default_rng(3)
    for _ in range(50):
        steps = random_sde_steps(10, 3, (0.0, 0.5), rng)
        assert len(set(steps)) == 3 and all(0 <= k < 5 for k in steps) and list(steps) == sorted(steps)
    assert random_sde_steps(10, 9, (0.0, 0.5), rng) == (0, 1, 2, 3, 4)


# --- DiffusionNFT -----------------------------------------------------------------------------------
def test_nft_optimality_and_decay_schedules():
    r = optimality(torch.tensor([5.0, -5.0, 0.0, 9.0, 2.5]), 5.0)
    assert r.tolist() == [1.0, 0.0, 0.5, 1.0, 0.75]
    assert [return_decay(s, 0) for s in (0, 10, 1000)] == [0.0, 0.0, 0.0]
    assert [return_decay(s, 1) for s in (0, 100, 499, 500, 5000)] == pytest.approx([0.0, 0.1, 0.499, 0.5, 0.5])
    assert [return_decay(s, 2) for s in (0, 74, 75, 175, 1000)] == pytest.approx([0.0, 0.0, 0.0, 0.75, 0.999])


def test_nft_loss_on_hand_computed_tensors():
    x0 = torch.tensor([[1.0, -1.0]])
    noise = torch.tensor([[0.5, 0.5]])
    t = torch.tensor([0.5])
    x_t = (1 - t[:, None]) * x0 + t[:, None] * noise  # [0.75, -0.25]
    v_old = torch.tensor([[0.0, 1.0]])
    v = torch.tensor([[1.0, 1.0]], requires_grad=True)
    beta, r = 0.5, torch.tensor([0.75])
    loss, _ = nft_policy_loss(v, v_old, x_t, x0, t, r, beta, 5.0)
    v_pos = torch.tensor([0.5, 1.0])  # β·v + (1−β)·v_old
    v_neg = torch.tensor([-0.5, 1.0])  # (1+β)·v_old − β·v
    x_pos, x_neg = x_t[0] - 0.5 * v_pos, x_t[0] - 0.5 * v_neg  # [0.5, -0.75], [1.0, -0.75]
    w_pos = (x_pos - x0[0]).abs().mean()  # (0.5 + 0.25)/2
    w_neg = (x_neg - x0[0]).abs().mean()  # (0 + 0.25)/2
    l_pos = ((x_pos - x0[0]) ** 2).mean() / w_pos
    l_neg = ((x_neg - x0[0]) ** 2).mean() / w_neg
    want = 5.0 * (0.75 * l_pos + 0.25 * l_neg) / beta
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    loss.backward()  # the adaptive weights are constants: the gradient of the formula with w fixed
    vv = v.detach().clone().requires_grad_(True)
    xp = x_t[0] - 0.5 * (beta * vv[0] + (1 - beta) * v_old[0])
    xn = x_t[0] - 0.5 * ((1 + beta) * v_old[0] - beta * vv[0])
    manual = 5.0 * (0.75 * ((xp - x0[0]) ** 2).mean() / w_pos + 0.25 * ((xn - x0[0]) ** 2).mean() / w_neg) / beta
    manual.backward()
    assert torch.allclose(v.grad, vv.grad, atol=1e-6)


def test_nft_gradient_at_the_old_policy_follows_two_r_minus_one():
    """At θ = θ_old, v⁺ = v⁻ = v_old and the loss gradient in v is ∝ (2r − 1)·t·(x̂0_old − x0)/w."""
    g = torch.Generator().manual_seed(4)
    x0, noise, v_old = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    t = torch.tensor([0.3, 0.6, 0.9])
    x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
    v = v_old.clone().requires_grad_(True)
    r = torch.tensor([1.0, 0.5, 0.0])
    loss, _ = nft_policy_loss(v, v_old, x_t, x0, t, r, 1.0, 5.0)
    loss.backward()
    assert v.grad[1].abs().max() < 1e-7  # r = ½: the two sides cancel
    err = x_t - t[:, None, None, None] * v_old - x0
    w = err.abs().mean(dim=(1, 2, 3))
    want = 5.0 * (2 * r - 1)[:, None, None, None] * (-2 * t[:, None, None, None] * err) / w[:, None, None, None] / 32 / 3
    assert torch.allclose(v.grad, want, atol=1e-6)


# --- the real flow: 2 iterations, a fault in update, resume ----------------------------------------
CASES = {
    "dance_grpo": ["sampling.sde_type=dance", "sampling.noise_level=0.3"],
    "mix_grpo": ["algorithm.window_size=2", "algorithm.iters_per_window=1"],
    "mix_grpo_flash": ["sampling.steps=8", "algorithm.window_size=2", "algorithm.iters_per_window=1",
                       "algorithm.compress_ratio=0.5"],
    "grpo_guard": ["algorithm.lora.enabled=false", "algorithm.clip_range=1e-4"],
    "flow_dppo": ["algorithm.num_sde_steps=1", "algorithm.lora.enabled=false"],
    "diffusion_nft": ["algorithm.lora.rank=4", "algorithm.lora.alpha=8"],
    "tempflow_grpo": ["algorithm.children=2", "algorithm.branch_steps=[0,2]", "algorithm.beta=0.01"],
    "online_sft": ["algorithm.noise_draws=3", "algorithm.sampler_sync_every=4"],
    "awm": ["algorithm.lora.enabled=false", "algorithm.train_timesteps=3", "algorithm.ema_kl_weight=0.5"],
    "dgpo": ["algorithm.lora.enabled=false", "algorithm.train_levels=2", "algorithm.trunc_steps=2",
             "algorithm.switch_ema_ref=0", "algorithm.kl_guidance=4.5"],  # CFG-free rollouts, a guided reference
    "crd": ["algorithm.lora.enabled=false", "algorithm.train_timesteps=2", "algorithm.optimizer_steps_per_iteration=1"],
    "v_grpo": ["algorithm.lora.enabled=false", "algorithm.pairs=2", "algorithm.optimizer_steps_per_iteration=2",
               "algorithm.clip_range=0.2", "algorithm.kl_weight=0.3"],
}
METRICS = {"dance_grpo": ["clipfrac"], "mix_grpo": ["clipfrac"], "mix_grpo_flash": ["clipfrac"],
           "grpo_guard": ["clipfrac_gt_one", "clipfrac_lt_one"],
           "flow_dppo": ["masked_fraction", "kl_mask_fraction", "pos_rm_fraction", "neg_rm_fraction"],
           "diffusion_nft": ["nft/old_decay", "old_deviate", "unweighted_policy_loss"],
           "tempflow_grpo": ["noise_weight", "kl", "part/0/reward_std", "part/1/reward_std"],
           "online_sft": ["err_w", "sigma_mean", "sft/sampler_synced"],
           "awm": ["awm/ema_decay", "awm/matching_loss", "ema_kl", "kl", "clipfrac"],
           "dgpo": ["dgpo/ema_decay", "dgpo/group_weight", "dgpo/dsm", "dgpo/samples_with_ema", "clipfrac", "kl"],
           "crd": ["crd/old_decay", "crd/sampling_decay", "crd/implicit_reward", "kl", "old_deviate"],
           "v_grpo": ["vgrpo/surrogate", "vgrpo/t", "clipfrac", "kl", "ratio_max", "ratio_min"]}


def _train(tiny_checkpoint, wd, run, name):
    from typer.testing import CliRunner

    from conftest import tiny_overrides
    from pixrl.cli import app

    args = tiny_overrides(tiny_checkpoint, wd, **{"sampling.window_size": "null", "sampling.window_range": "null"})
    return CliRunner().invoke(app, ["train", "--iterations", "2", "--run", run, "--config", f"shapes_{name}",
                                    "reward=jpeg_compressibility", *args, *CASES[name]])


def _rows(wd, run):
    import lance

    t = lance.dataset(str(wd / "lance" / run / "trajectories.lance")).to_table()
    return t.drop_columns(["run_id"]).sort_by("sample_id")


def _final(wd, run):
    from safetensors.torch import load_file

    (ck,) = (wd / "checkpoints" / run).glob("*/it_0001")
    return load_file(str(ck / "trainable.safetensors")), ck


@pytest.mark.parametrize("name", list(CASES))
def test_two_iterations_then_resume_after_a_fault_in_update(name, tiny_checkpoint, tmp_path, monkeypatch,
                                                            prefect_harness):
    from mlflow.tracking import MlflowClient

    from conftest import fault_then_resume

    ref = tmp_path / "ref"
    res = _train(tiny_checkpoint, ref, "ref", name)
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    t = _rows(ref, "ref")
    parts = 2 if name == "tempflow_grpo" else 1  # its two branch steps: one group per prompt and step
    assert t.num_rows == 16 * parts and all(t[c].null_count == 0 for c in ("image", "reward", "advantage"))
    client = MlflowClient(f"sqlite:///{ref / 'mlflow.db'}")
    versions = client.search_model_versions(f"name='{out['model_name']}'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    m = client.get_run(out["run_id"]).data.metrics
    assert all(k in m for k in METRICS[name]), sorted(m)
    weights, _ = _final(ref, "ref")
    base = {}
    if name != "diffusion_nft":
        from safetensors.torch import load_file

        base = load_file(str(tiny_checkpoint / "transformer" / "diffusion_pytorch_model.safetensors"))
        assert any(not torch.equal(weights[k], base[k]) for k in base if k in weights), "no weight moved"
    recipes = [json.loads(r) for r in t["recipe"].to_pylist()]

    if name == "diffusion_nft":
        assert "log_probs" not in t.column_names and "latents" not in t.column_names  # final latents only
        assert all(r["ode_solver"] == "dpm2" and r["noise_level"] == 0 for r in recipes)
        assert m["nft/old_decay"] == pytest.approx(0.002)  # two optimizer steps so far: min(0.001·2, 0.5)
    elif name == "awm":
        assert "log_probs" not in t.column_names and "latents" not in t.column_names  # final latents only
        assert all(r["ode_solver"] == "euler" and r["noise_level"] == 0 for r in recipes)
        assert m["awm/ema_decay"] == pytest.approx(0.002) and m["onpolicy_ratio_dev"] == 0
    elif name == "dgpo":
        assert "log_probs" not in t.column_names and "latents" not in t.column_names  # final latents only
        assert all(r["ode_solver"] == "dpm2" and r["noise_level"] == 0 for r in recipes)
        assert m["dgpo/ema_decay"] == pytest.approx(0.001) and m["dgpo/samples_with_ema"] == 1  # past the switch
    elif name == "crd":  # CFG-free rollouts of the sampling snapshot, the KL's base guided at 4.5
        assert "log_probs" not in t.column_names and "latents" not in t.column_names  # final latents only
        assert all(r["ode_solver"] == "euler" and r["noise_level"] == 0 and r["guidance_scale"] == 1 for r in recipes)
        assert m["crd/old_decay"] == pytest.approx(0.26) and m["crd/sampling_decay"] == 0
    elif name == "v_grpo":
        assert "log_probs" not in t.column_names and "latents" not in t.column_names  # final latents only
        assert all(r["ode_solver"] == "dpm2" and r["noise_level"] == 0 for r in recipes)
        assert m["onpolicy_ratio_dev"] == 0 and m["optimizer_steps"] == 2
        assert m["ratio_max"] > 1 or m["ratio_min"] < 1  # the second step's ratio to the update's start
    elif name == "online_sft":
        assert "log_probs" not in t.column_names and "latents" not in t.column_names  # final latents only
        assert all(r["noise_level"] == 0.7 and r["sde_steps"] is None and r["train_steps"] == [] for r in recipes)
        assert m["optimizer_steps"] == 3  # a pass per noise draw, one optimizer step each
        assert m["sft/sampler_synced"] == 1  # steps 3 → 6 crossed 4: the sampler took the trained weights
    else:
        assert m["onpolicy_ratio_dev"] == 0  # rollout → replay, bit for bit (GRPO-Guard: ρ̃ itself)
    if name in ("grpo_guard", "flow_dppo"):
        assert "means" in t.column_names and t["means"].null_count == 0
    if name in ("dance_grpo", "mix_grpo", "mix_grpo_flash"):
        seeds = np.array(t["noise_seed"].to_pylist())
        groups = np.array(t["group_id"].to_pylist()) + 100 * np.array(t["iteration"].to_pylist())
        assert all(len(set(seeds[groups == g])) == 1 for g in set(groups)) and len(set(seeds)) == len(set(groups))
    if name.startswith("mix_grpo"):
        it0 = [r for r, i in zip(recipes, t["iteration"].to_pylist()) if i == 0]
        it1 = [r for r, i in zip(recipes, t["iteration"].to_pylist()) if i == 1]
        moved = [1] if name == "mix_grpo" else [1, 2]  # 4 steps: trainable 0..1, the window shrinks; 8: 0..5
        assert it0[0]["train_steps"] == [0, 1] and it1[0]["train_steps"] == moved  # the window moved
        steps = t["stored_steps"].combine_chunks().flatten().to_numpy().reshape(-1, 2)
        assert {tuple(r) for r in steps} == {(0, 1), tuple(moved + [-1] * (2 - len(moved)))}
        lat = t["latents"].combine_chunks().to_numpy_ndarray()[:, 0]
        first = np.array(t["iteration"].to_pylist()) == 0
        g0 = first & (np.array(t["group_id"].to_pylist()) == 0)
        assert np.all(lat[g0] == lat[g0][0])  # the group starts from one latent (ODE before the window)
    if name == "dance_grpo":
        assert all(r["sde_type"] == "dance" and r["train_steps"] == [0, 1, 2] for r in recipes)
    if name == "tempflow_grpo":
        _check_branches(t, recipes)

    wd = tmp_path / "A"
    fault_then_resume(monkeypatch, lambda: _train(tiny_checkpoint, wd, "A", name), wd, "A")
    resumed, ck = _final(wd, "A")
    assert all(resumed[k].equal(weights[k]) for k in weights), "resumed weights differ"
    assert _rows(wd, "A").equals(t)
    if name in ("diffusion_nft", "online_sft", "awm", "dgpo", "crd"):  # the sampling policy (or EMA anchor) resumed too
        from pixrl.artifacts.checkpoints import load_optimizer_state
        from pixrl.engines.policy import ALGORITHM_STATE

        a = load_optimizer_state(ck)[ALGORITHM_STATE]
        (ref_ck,) = (ref / "checkpoints" / "ref").glob("*/it_0001")
        b = load_optimizer_state(ref_ck)[ALGORITHM_STATE]
        key = {"diffusion_nft": "old", "online_sft": "sampler", "awm": "ema", "dgpo": "ema", "crd": "old"}[name]
        assert a["step"] == b["step"] == (6 if name == "online_sft" else 2)
        assert all(a[key][k].equal(b[key][k]) for k in b[key])


def _check_branches(t, recipes):
    """TempFlow's rows: each group one prompt at one branch step, the step stored and the only
    stochastic one; a base's two children start from one latent, the same in both parts, so they
    agree up to the branch (x_0 equal at step 0's group; x_2 equal at step 2's)."""
    groups, it = np.array(t["group_id"].to_pylist()), np.array(t["iteration"].to_pylist())
    members, seeds = np.array(t["sample_index"].to_pylist()), np.array(t["noise_seed"].to_pylist())
    steps = t["stored_steps"].combine_chunks().flatten().to_numpy()
    assert all(r["sde_steps"] == r["train_steps"] == [k] for r, k in zip(recipes, steps))
    assert set(groups) == {0, 1, 2, 3} and np.all(steps == np.where(groups >= 2, 2, 0))  # P = 2 prompts a part
    prompts = np.array(t["prompt"].to_pylist())
    for i in (0, 1):
        for g in range(4):
            same = (it == i) & (groups % 2 == g % 2) & (members // 2 == g // 2)
            assert len(set(seeds[same])) == 1 and len(set(prompts[same])) == 1  # base g//2 of one prompt
    lat = t["latents"].combine_chunks().to_numpy_ndarray()[:, 0]
    nxt = t["next_latents"].combine_chunks().to_numpy_ndarray()[:, 0]
    a, b = (it == 0) & (groups == 2) & (members == 0), (it == 0) & (groups == 2) & (members == 1)
    assert np.array_equal(lat[a], lat[b]) and not np.array_equal(nxt[a], nxt[b])  # the branch: x_j shared


def test_a_setting_of_another_algorithm_is_refused_naming_the_valid_ones():
    from pixrl.config.loader import ConfigError, load_config
    from pixrl.stages.preflight import PreflightError, preflight

    from pixrl.algorithms.base import build_algorithm

    cfg = load_config("shapes_dance_grpo", ["algorithm.window_size=3"])
    with pytest.raises(ConfigError) as err:  # building the algorithm validates its own settings (preflight does)
        build_algorithm(cfg.algorithm)
    assert "window_size" in str(err.value) and "train_fraction" in str(err.value)
    with pytest.raises(PreflightError, match="sampling.sde_type=dance"):
        preflight(load_config("shapes_dance_grpo", ["sampling.sde_type=sde"]))
    with pytest.raises(PreflightError, match="guidance_scale=1"):
        preflight(load_config("shapes_diffusion_nft", ["sampling.guidance_scale=4.5"]))
    with pytest.raises(PreflightError, match="unset sampling.window_size"):
        preflight(load_config("shapes_mix_grpo", ["sampling.window_size=2"]))


def test_dpo_sigmas_follow_the_shifted_training_schedule():
    """flow_grpo draws DPO's σ from SD3's shifted schedule: with shift 3 the 10/50/90th percentiles are
    ≈ 0.46/0.75/0.92 (unshifted logit-normal: ≈ 0.22/0.50/0.78)."""
    from pixrl.algorithms.diffusion_dpo import sample_sigmas

    s = sample_sigmas(200_000, "logit_normal", torch.Generator().manual_seed(0))
    assert np.allclose(np.quantile(s.numpy(), [0.1, 0.5, 0.9]), [0.22, 0.50, 0.78], atol=0.01)
    assert np.allclose(np.quantile(shifted(s, 3.0).numpy(), [0.1, 0.5, 0.9]), [0.46, 0.75, 0.92], atol=0.01)
