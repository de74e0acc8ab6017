"""Online SFT against flow_grpo's SFT written out (`train_sd3_sft.py`, `PerPromptStatTracker` with
type='sft'): each group's maxima weighted (1/G: upstream's 1 averaged over a batch of G rows per
winner), the flow-matching loss on the winners' final latents at σ from the training schedule, one
noise draw and one optimizer step per pass, the sampler synced when the optimizer steps cross a
multiple of `sampler_sync_every`, and the refusals."""

import numpy as np
import pytest
import torch

from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.online_sft import best_of_group
from pixrl.algorithms.sampling import SamplerRecipe
from pixrl.config.loader import load_config
from pixrl.stages.plan import make_plan


def _algo(*overrides):
    return build_algorithm(load_config("shapes_online_sft", list(overrides)).algorithm)


def test_weights_are_upstreams_max_indicator_over_the_group_size():
    r = np.array([0.1, 0.9, 0.3, 0.9, 0.5, 0.5, 0.5, 0.5, 0.2, 0.7])
    g = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    out = best_of_group(r, g)
    for grp in (0, 1, 2):  # upstream: (rewards == max(rewards)).float(), per prompt
        idx = g == grp
        want = (torch.tensor(r[idx]) == torch.tensor(r[idx]).max()).float().numpy() / idx.sum()
        assert np.allclose(out.advantages[idx], want)
    assert out.advantages[4:8].tolist() == [0.25] * 4  # a flat group trains every member
    assert out.zero_std_ratio == pytest.approx(1 / 3)
    algo = _algo()
    assert algo.trains_on(out.advantages, g).tolist() == (out.advantages != 0).tolist()
    first = best_of_group(r, g, ties="first", min_spread=0.0)  # one winner a group; flat groups train none
    assert np.flatnonzero(first.advantages).tolist() == [1, 9] and first.advantages[1] == 0.25
    spread = best_of_group(r, g, min_spread=0.5).advantages  # 0.7 − 0.2 ≤ 0.5: group 2 trains none
    assert spread[8:].tolist() == [0.0, 0.0] and spread[[1, 3]].tolist() == [0.25, 0.25]


def test_the_loss_is_the_weighted_flow_matching_error_at_training_schedule_sigmas(tiny_checkpoint):
    from types import SimpleNamespace

    from pixrl.algorithms.diffusion_dpo import draw_noise_levels
    from pixrl.models.registry import get_family

    fam = get_family("sd3").load(tiny_checkpoint, max_sequence_length=0)
    algo = _algo()
    cond = fam.encode_prompts(["a red circle", "two blue squares"])
    x0 = torch.randn(2, *fam.latent_shape(), generator=torch.Generator().manual_seed(1))
    batch = {"final_latent": x0.numpy(), "advantage": np.array([0.125, 0.0625], dtype=np.float32)}

    def policy(seed):
        return SimpleNamespace(model=fam, cond=cond, device=torch.device("cpu"), tensor=torch.as_tensor,
                               generator=torch.Generator().manual_seed(seed), trained_steps=None,
                               recipe=SamplerRecipe(4, 0.7, guidance_scale=4.5))  # CFG: trained conditional

    (loss, metrics), = list(algo.losses(batch, policy(5)))
    p = policy(5)  # the same draws, written out: σ, then ε, from the pass's generator
    sigma = draw_noise_levels(2, algo.settings, p)
    eps = torch.randn(x0.shape, generator=p.generator)
    s = sigma.reshape(-1, 1, 1, 1)
    with torch.no_grad():
        v = fam.velocity((1 - s) * x0 + s * eps, sigma * 1000, cond)
    err = ((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(loss.detach(), (torch.tensor([0.125, 0.0625]) * err).mean(), rtol=1e-5)
    assert torch.allclose(metrics["err_w"], err.mean(), rtol=1e-5) and torch.equal(metrics["sigma_mean"], sigma.mean())


def test_an_iteration_takes_a_pass_and_an_optimizer_step_per_noise_draw():
    algo = _algo("algorithm.noise_draws=3", "algorithm.optimizer_steps_per_iteration=2")
    ids = [f"s{i}" for i in range(8)]
    keep = np.array([1, 0, 1, 0, 1, 0, 1, 0], dtype=bool)
    plan = make_plan(ids, keep, micro_batch=1, optimizer_steps=2, passes=algo.passes)
    one = [[["s0"], ["s2"]], [["s4"], ["s6"]]]
    assert algo.passes == 3 and plan.steps == one * 3
    assert make_plan(ids, keep, 1, 2).steps == one  # one pass otherwise


def test_the_sampler_takes_the_trained_weights_at_each_multiple_of_sync_steps():
    algo = _algo("algorithm.sampler_sync_every=4")
    assert algo.separate_sampler and algo.sampling_weights() is None
    w = {"a": torch.zeros(2)}
    algo.set_sampling_weights({"a": torch.full((2,), -1.0)})  # the pre-update weights, as the update sets them
    synced = []
    for step in range(1, 5):  # 3 optimizer steps an update: 3, 6, 9, 12
        w = {"a": torch.full((2,), float(step))}
        synced.append(algo.end_of_update(w, 3)["sft/sampler_synced"])
    assert synced == [0.0, 1.0, 1.0, 1.0] and algo.sampling_weights()["a"].tolist() == [4.0, 4.0]
    restored = _algo("algorithm.sampler_sync_every=4")
    restored.load_state(algo.state())
    assert restored.state()["step"] == 12 and restored.sampling_weights()["a"].tolist() == [4.0, 4.0]
    assert not _algo().separate_sampler and _algo().end_of_update(w, 3) == {}  # the current policy samples


def test_refusals():
    from pixrl.stages.preflight import PreflightError, preflight

    with pytest.raises(PreflightError, match="stores no transitions.*unset sampling.window_size"):
        preflight(load_config("shapes_online_sft", ["sampling.window_size=2", "sampling.window_range=[0,2]"]))
    with pytest.raises(PreflightError, match="token families: token_sft"):
        preflight(load_config("shapes_online_sft", ["model=mini_janus", "sampling=janus_token_cpu"]))
