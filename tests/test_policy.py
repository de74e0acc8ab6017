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


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def test_a_lora_frozen_copy_shares_the_base_and_costs_its_adapter(tiny_checkpoint, tmp_path):
    """A frozen view under LoRA (DiffusionNFT's sampler, AWM's anchor, an explicit reference)
    holds its own adapter and the trained module's base parameters, not a copy of them; it
    computes what a whole copy with the same weights computes, bit for bit, and stays put while
    the trained adapter takes an optimizer step."""
    import copy

    extra = ["algorithm.lora.enabled=true", "algorithm.lora.rank=4", "algorithm.lora.init=gaussian"]
    pol = TrainablePolicy(load_config(None, [*tiny_overrides(tiny_checkpoint, tmp_path), *extra]))
    fam = pol.family
    x, t = torch.randn(2, *fam.latent_shape(), generator=torch.Generator().manual_seed(0)), torch.tensor([500.0])
    cond = fam.encode_prompts(["a red circle", "a blue square"])
    weights = {k: v.detach() + 0.01 for k, v in pol.trainable_parameters().items()}
    view = pol.frozen_view(weights, slot="anchor")
    held = pol._frozen["anchor"]
    live = dict(pol.module.named_parameters())
    own = [p for n, p in held.named_parameters() if p is not live[n]]
    assert {n for n, p in held.named_parameters() if p is not live[n]} == set(pol.trainable_parameters())
    assert _bytes(own) == _bytes(pol.trainable_parameters().values()) < _bytes(live.values()) / 10
    assert all(not p.requires_grad for p in own)
    live_buffers = dict(pol.module.named_buffers())
    assert all(b is live_buffers[n] for n, b in held.named_buffers())  # constant tables: shared too

    whole = copy.deepcopy(pol.module).requires_grad_(False)  # what a frozen view was before: a whole copy
    pol._fill(whole, weights, "whole copy")
    before = view.velocity(x, t, cond)
    assert torch.equal(before, pol.module_call(whole, "velocity", x, t, cond))
    assert not torch.equal(before, pol.reference_call("velocity", x, t, cond))

    opt = torch.optim.SGD(list(pol.trainable_parameters().values()), lr=0.1)
    fam.velocity(x, t, cond).square().mean().backward()
    assert all(p.grad is None for p in held.parameters())  # the shared base gets no gradient either
    opt.step()
    assert not torch.equal(fam.velocity(x, t, cond), pol.module_call(whole, "velocity", x, t, cond))
    assert torch.equal(view.velocity(x, t, cond), before)


def test_a_full_finetune_frozen_copy_owns_every_trained_tensor(tiny_checkpoint, tmp_path):
    pol = TrainablePolicy(load_config(None, tiny_overrides(tiny_checkpoint, tmp_path)))
    pol.frozen_view(pol._snapshot(), slot="sampler")
    live = dict(pol.module.named_parameters())
    trained = set(pol.trainable_parameters())
    for n, p in pol._frozen["sampler"].named_parameters():
        assert (p is live[n]) == (n not in trained), n
        assert not p.requires_grad
