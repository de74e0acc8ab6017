"""The algorithm contract: registry errors and Flow-GRPO's transition loss with KL."""

import numpy as np
import pytest
import torch

from pixrl.algorithms.base import build_algorithm
from pixrl.algorithms.flow_sde import flow_step
from pixrl.config.schema import AlgorithmConfig


def test_unknown_algorithm_lists_registered():
    with pytest.raises(KeyError, match="registered algorithms: flow_grpo"):
        build_algorithm(AlgorithmConfig(name="dpo-typo"))


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
