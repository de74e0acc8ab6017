"""The algorithm contract: registry errors and Flow-GRPO's transition loss with KL."""

import numpy as np
import pytest
import torch

from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.flow_sde import flow_step
from pixrl.config.schema import AlgorithmConfig


def test_unknown_algorithm_lists_registered():
    with pytest.raises(KeyError, match="registered algorithms: awm, crd, dance_grpo, ddpo, dgpo, diffusion_dpo, diffusion_nft, diffusion_opd, diffusion_sft, draft, flow_dppo, "
                                       "flow_grpo, gardo, grpo_guard, mix_grpo, mix_grpo_flash, online_dpo, online_sft, refl, srpo, tempflow_grpo, token_dpo, token_grpo, "
                                       "token_sft, v_grpo"):
        build_algorithm(AlgorithmConfig(name="dpo-typo"))


def test_each_algorithm_validates_its_own_settings():
    """Flow-GRPO's keys live in its own settings model; a typo names the key, a close match and
    the algorithm's keys; a bad value names the constraint. Diffusion-DPO (offline) is registered."""
    with pytest.raises(ValueError, match=r"'algorithm.clip_rnge' for algorithm 'flow_grpo' \(did you mean "
                                         r"'algorithm.clip_range'\?\)"):
        build_algorithm(AlgorithmConfig(clip_rnge=0.2))
    with pytest.raises(ValueError, match="algorithm.beta: Input should be greater than or equal to 0"):
        build_algorithm(AlgorithmConfig(beta=-1))
    algo = build_algorithm(AlgorithmConfig(clip_range=0.2))
    assert algo.settings.clip_range == 0.2 and algo.settings.std_eps == 1e-4 and not algo.offline
    dpo = build_algorithm(AlgorithmConfig(name="diffusion_dpo", beta=50))
    assert dpo.offline and dpo.needs == {"final_latent"} and dpo.needs_reference
    assert dpo.settings.beta == 50 and dpo.settings.timesteps == "logit_normal"
    with pytest.raises(ValueError, match="unknown key 'algorithm.clip_range' for algorithm 'diffusion_dpo'"):
        build_algorithm(AlgorithmConfig(name="diffusion_dpo", clip_range=0.2))
    with pytest.raises(ValueError, match="algorithm.timesteps: Input should be 'logit_normal', 'uniform' or 'ddpm'"):
        build_algorithm(AlgorithmConfig(name="diffusion_dpo", timesteps="cosine"))


def test_flow_grpo_loss_adds_beta_kl():
    algo = build_algorithm(AlgorithmConfig(beta=0.5, clip_range=1e-4))
    assert algo.needs_reference and {"latents", "next_latents", "log_probs"} <= algo.needs
    g = torch.Generator().manual_seed(0)
    x, v, eps = (torch.randn(2, 4, 3, 3, generator=g) for _ in range(3))
    new = flow_step(v, x, torch.tensor(0.8), torch.tensor(0.6), 0.9, 0.7, noise=eps)
    ref = flow_step(v + 0.1, x, torch.tensor(0.8), torch.tensor(0.6), 0.9, 0.7, prev_sample=new.prev_sample)
    loss, m = algo.transition_loss(new, new.log_prob, torch.tensor([1.0, -1.0]), ref)
    kl = (((new.mean - ref.mean) ** 2).mean(dim=(1, 2, 3)) / (2 * new.std_dev_t**2)).mean()
    assert torch.allclose(m["kl"], kl)
    assert torch.allclose(loss, 0.5 * kl)  # ρ = 1 and advantages cancel: the PG term is 0
    adv = algo.advantages(np.array([1.0, 2.0, 3.0, 3.0]), np.array([0, 0, 1, 1]))
    assert adv.zero_std_ratio == 0.5
