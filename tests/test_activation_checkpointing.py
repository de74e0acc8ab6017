"""`model.gradient_checkpointing`: every family's trained module recomputes its blocks in the
backward — the same output and bit-identical gradients, fewer tensors kept for the backward —
while a deep copy (the KL reference) computes with its own weights, `no_grad` forwards are
untouched, and a run with it trains to the same weights as one without."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import train_args
from pixrl.cli import app
from pixrl.config.loader import load_config
from pixrl.engines.activation_checkpointing import enable_activation_checkpointing
from pixrl.engines.policy import TrainablePolicy
from pixrl.models.registry import get_family

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from activation_memory import trained_forward  # noqa: E402  (the update's forward, for every family)

FAMILIES = ["sd3", "flux1", "flux2", "qwen_image", "sana", "wan", "janus_pro", "glm_image", "glm_image_ar", "hunyuan_image", "ltx2"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return {}


def _policy(tiny_dirs, tmp_path_factory, family: str, checkpointing: bool) -> TrainablePolicy:
    if family not in tiny_dirs:
        out = tmp_path_factory.mktemp("ckpt") / f"tiny-{family}"
        tiny_dirs[family] = (out, get_family(family).write_tiny(out, seed=0))
    path, overrides = tiny_dirs[family]
    cfg = load_config(None, [*(f"{k}={v}" for k, v in overrides.items()),
                             f"model.gradient_checkpointing={str(checkpointing).lower()}",
                             "sampling.guidance_scale=2.0"])  # CFG rows (or the embedded scale) in the forward
    return TrainablePolicy(cfg)


def _grads_and_saved(policy: TrainablePolicy) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    policy.module.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = trained_forward(policy, 2)
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in policy.trainable_parameters().items() if p.grad is not None}
    return out.detach(), grads, sum(saved)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_output_and_gradients_with_fewer_saved_tensors(family, tiny_dirs, tmp_path_factory):
    plain = _policy(tiny_dirs, tmp_path_factory, family, False)
    out0, grads0, saved0 = _grads_and_saved(plain)
    ckpt = _policy(tiny_dirs, tmp_path_factory, family, True)
    assert any(getattr(m, "_pixrl_checkpointed", False) for m in ckpt.module.modules())
    out1, grads1, saved1 = _grads_and_saved(ckpt)
    assert torch.equal(out0, out1)
    assert grads0 and grads0.keys() == grads1.keys()
    assert all(torch.equal(grads0[k], grads1[k]) for k in grads0), "a gradient changed under checkpointing"
    assert saved1 < saved0, (saved1, saved0)


def test_a_deep_copy_computes_with_its_own_weights_and_no_grad_is_untouched(tiny_dirs, tmp_path_factory):
    policy = _policy(tiny_dirs, tmp_path_factory, "sd3", True)
    with torch.no_grad():
        before = trained_forward(policy, 2)
    twin = copy.deepcopy(policy.module)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        again = trained_forward(policy, 2)  # the original's blocks still use the original's weights
    assert torch.equal(before, again)
    block = next(m for m in twin.modules() if getattr(m, "_pixrl_checkpointed", False))
    original = next(m for m in policy.module.modules() if getattr(m, "_pixrl_checkpointed", False))
    assert type(block) is type(original) and block.forward.__self__ is block
    assert enable_activation_checkpointing(policy.family, policy.module) > 0  # idempotent
    assert sum(type(m).__name__.startswith("CheckpointedCheckpointed") for m in policy.module.modules()) == 0


def test_a_run_with_checkpointing_trains_to_the_same_weights(tiny_checkpoint, tmp_path: Path, prefect_harness):
    finals = []
    for on in (False, True):
        work = tmp_path / f"gc-{on}"
        res = CliRunner().invoke(app, train_args(tiny_checkpoint, work, "gc", f"model.gradient_checkpointing={str(on).lower()}",
                                                 iterations=1))
        assert res.exit_code == 0, res.output + repr(res.exception)
        json.loads(res.stdout.strip().splitlines()[-1])
        (ck,) = sorted((work / "checkpoints" / "gc").glob("*/it_*"))
        finals.append(load_file(str(ck / "trainable.safetensors")))
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_a_sharded_checkpointed_update_equals_one_plain_process():
    """FSDP wraps the checkpointed blocks in its own subclass: its gathering hooks stay outside
    the recomputed forward. Three optimizer steps of a full fine-tune with a KL reference on a
    2-rank gloo group with checkpointing, against one process without (test_fsdp_init's check)."""
    from fsdp_families import check

    threads = torch.get_num_threads()
    try:
        assert check("flux1", "float32", rank_overrides=("model.gradient_checkpointing=true",)) < 1e-5
    finally:
        torch.set_num_threads(threads)
