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


def test_an_algorithms_own_reference_and_back_to_the_base(tiny_checkpoint, tmp_path):
    """GARDO's adaptive reference (set_reference with the policy's weights) and the base again
    (use_base_reference), for a full fine-tune and for LoRA; the copy is refilled, not rebuilt."""
    for lora in (False, True):
        extra = ["algorithm.lora.enabled=true", "algorithm.lora.rank=4", "algorithm.lora.init=gaussian"] if lora else []
        pol = TrainablePolicy(load_config(None, [*tiny_overrides(tiny_checkpoint, tmp_path), *extra]))
        fam = pol.family
        x, t = torch.randn(2, *fam.latent_shape()), torch.tensor([500.0])
        cond = fam.encode_prompts(["a red circle", "a blue square"])
        with torch.no_grad():
            base = pol.reference_call("velocity", x, t, cond)
            for p in pol.trainable_parameters().values():
                p.add_(0.01)
            moved = fam.velocity(x, t, cond)
        assert not torch.allclose(base, moved)
        pol.set_reference({k: v.detach().clone() for k, v in pol.trainable_parameters().items()})
        copy = pol._reference
        assert torch.equal(pol.reference_call("velocity", x, t, cond), moved)
        pol.set_reference(pol._base_state if not lora else {k: torch.zeros_like(v) if "lora_B" in k else v
                                                             for k, v in pol._snapshot().items()})
        assert pol._reference is copy  # refilled in place
        pol.use_base_reference()
        assert torch.equal(pol.reference_call("velocity", x, t, cond), base)
