"""Trainable selection and the KL reference of a full fine-tune (a frozen copy of the base)."""

import torch

from conftest import tiny_overrides
from pixrl.config.loader import load_config
from pixrl.engines.policy import TrainablePolicy


def test_full_finetune_reference_is_the_frozen_base(tiny_checkpoint, tmp_path):
    cfg = load_config(None, tiny_overrides(tiny_checkpoint, tmp_path))
    pol = TrainablePolicy(cfg)
    fam = pol.family
    x = torch.randn(2, *fam.latent_shape())
    t = torch.tensor([500.0])
    cond = fam.encode_prompts(["a red circle", "a blue square"])
    assert torch.equal(pol.reference_call("velocity", x, t, cond), fam.velocity(x, t, cond))
    with torch.no_grad():
        for p in pol.trainable_parameters().values():
            p.add_(0.01)
    assert not torch.allclose(pol.reference_call("velocity", x, t, cond), fam.velocity(x, t, cond))
    assert all(not p.requires_grad for p in pol._reference.parameters())
    # back to the base weights
    pol.weights_id = "dirty"
    pol.load_version(None)
    assert torch.equal(pol.reference_call("velocity", x, t, cond), fam.velocity(x, t, cond))
