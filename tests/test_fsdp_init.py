"""FSDP start-up without the whole model on every rank (engines/fsdp.py): rank 0 loads the
trained module, the others build it with no storage and receive their shards. The family
loaders' meta mode on the real tiny checkpoints; the group steps on a real 2-rank gloo group.
The end-to-end equality of a sharded update with one process's is in test_ray_engine.py."""

from __future__ import annotations

import socket
import traceback

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from pixrl.models.registry import get_family


def _load(path, trainable_device=None, dtype="float32", family="sd3"):
    kwargs = {"trainable_device": trainable_device} if trainable_device else {}
    return get_family(family).load(path, dtype=dtype, device="cpu", **kwargs)


def _layout(module):
    return {n: tuple(p.shape) for n, p in module.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("which", ["sd3", "wan", "janus_pro"])
def test_a_meta_built_trained_module_has_the_checkpoints_layout_and_no_storage(which, request):
    if which == "sd3":
        path, dtype = request.getfixturevalue("tiny_checkpoint"), "float32"
    else:
        path = request.getfixturevalue("tiny_wan" if which == "wan" else "tiny_janus")[0]
        dtype = "bfloat16" if which == "wan" else "float32"  # Wan keeps some modules in float32 when loaded
    loaded, empty = _load(path, dtype=dtype, family=which), _load(path, "meta", dtype, which)
    module = empty.trainable_module()
    assert all(p.is_meta for p in module.parameters())
    assert _layout(module) == _layout(loaded.trainable_module())
    if which != "janus_pro":  # the other components are loaded as usual
        assert not any(p.is_meta for p in empty.vae.parameters())
    if which == "wan":  # what `align` fixes before sharding: the loader's float32 exceptions
        want = {n: p.dtype for n, p in loaded.trainable_module().named_parameters()}
        differ = {n for n, p in module.named_parameters() if p.dtype != want[n]}
        assert differ and all(want[n] == torch.float32 for n in differ)
    if which == "janus_pro":
        assert module.lm_head.weight is module.model.language_model.embed_tokens.weight  # tied, as loaded


class _Toy(torch.nn.Module):
    """Two blocks, a head tied to the embedding, a gain, a non-persistent buffer (rank 0 makes
    one block, the gain and the buffer bfloat16)."""

    def __init__(self, extra: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("table", torch.arange(6.0) * 0.5, persistent=False)
        self.gain = torch.nn.Parameter(torch.ones(6))  # rank 0 keeps it bfloat16 beside float32 weights
        if extra:
            self.extra = torch.nn.Linear(6, 6)

    def forward(self, ids):
        x = self.embed(ids) + self.table
        for block in self.blocks:
            x = block(x.to(block.weight.dtype)).float()
        return self.head(self.norm(x) * self.gain.float())


def _reference_toy() -> _Toy:
    torch.manual_seed(0)
    toy = _Toy()
    toy.blocks[1].to(torch.bfloat16)
    toy.gain.data = toy.gain.data.to(torch.bfloat16) * 1.5  # one unit (the root), two trainable dtypes
    toy.register_buffer("table", (toy.table * 3.0).to(torch.bfloat16), persistent=False)  # only rank 0 has it
    return toy


def _host(t: torch.Tensor):
    return t.float().numpy().copy()  # bfloat16 → float32 is exact


def _rank(rank: int, master: str, mode: str, out) -> None:
    from accelerate import init_empty_weights

    from pixrl.engines.collective import TorchDistributed
    from pixrl.engines.fsdp import _sharded, align, fill_like, full, materialize, shard_module, skeleton

    try:
        torch.set_num_threads(1)
        TorchDistributed.join(rank, 2, master, "gloo", sharded=True)
        if rank == 0:
            module = _reference_toy()
        else:
            with init_empty_weights(include_buffers=False):
                module = _Toy(extra=mode == "mismatch")
            module.head.weight = module.embed.weight  # the module's own tie (the context re-creates parameters)
        try:
            align(module, "toy")
        except RuntimeError as exc:
            out.put((rank, "error", str(exc)))
            return
        if mode == "mismatch":
            out.put((rank, "aligned", None))
            return
        source = dict(module.state_dict()) if rank == 0 else {}
        frozen = skeleton(module)
        for m in (module, frozen):
            shard_module(m, "cpu")
        materialize(module, torch.device("cpu"), source)
        fill_like(frozen, module)
        values = {n: _host(full(p.detach())) for n, p in module.named_parameters()}  # by value: the
        logits = module(torch.tensor([[1, 2, 3]]))  # queue's shared tensors die with this process
        frozen_logits = frozen(torch.tensor([[1, 2, 3]]))
        out.put((rank, "ok", {"values": values, "table": _host(module.table), "logits": _host(logits.detach()),
                              "frozen_logits": _host(frozen_logits.detach()), "frozen_table": str(frozen.table.dtype),
                              "table_dtype": str(module.table.dtype), "gain_sharded": _sharded(module.gain),
                              "tied": module.head.weight is module.embed.weight,
                              "dtypes": {n: str(p.dtype) for n, p in module.named_parameters()}}))
    except Exception:
        out.put((rank, "crash", traceback.format_exc()))


def _group(mode: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, master, mode, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, status, payload = out.get(timeout=240)
        got[rank] = (status, payload)
    for p in procs:
        p.join(timeout=60)
    return got


def test_a_rank_built_without_storage_receives_rank_0s_weights_buffers_ties_and_dtypes():
    got = _group("ok")
    assert {r: s for r, (s, _) in got.items()} == {0: "ok", 1: "ok"}, got
    want = _reference_toy()
    for rank in (0, 1):
        res = got[rank][1]
        assert res["tied"], f"rank {rank}: the head came apart from the embedding"
        assert res["dtypes"]["blocks.1.weight"] == "torch.bfloat16" and res["dtypes"]["blocks.0.weight"] == "torch.float32"
        for name, p in want.named_parameters():
            np.testing.assert_array_equal(res["values"][name], _host(p.detach()), err_msg=f"rank {rank}: {name}")
        np.testing.assert_array_equal(res["table"], _host(want.table))
        assert res["table_dtype"] == res["frozen_table"] == "torch.bfloat16"  # rank 0's, not the constructor's
        assert res["dtypes"]["gain"] == "torch.bfloat16" and not res["gain_sharded"]  # whole: not the root's dtype
        np.testing.assert_array_equal(res["logits"], got[0][1]["logits"])
        np.testing.assert_array_equal(res["frozen_logits"], res["logits"])  # the frozen copy, filled shard for shard


def test_ranks_that_built_different_modules_stop_with_the_parameter_named():
    got = _group("mismatch")
    status, message = got[1]
    assert status == "error", got
    assert "rank 1 built the toy unlike rank 0" in message and "extra.bias" in message and "rank 0 lacks" in message
    assert "same checkpoint" in message


def test_a_bfloat16_wan_update_sharded_over_two_ranks_equals_one_process():
    """Wan's loader keeps its norms and modulation tables in float32 under a bfloat16 model, and
    FSDP reduce-scatters one dtype per unit: those stay whole and all-reduced (`odd_dtype`).
    Three optimizer steps of a full fine-tune with a KL reference, rank 1 built empty; bfloat16
    weights of either update round alike to within a fraction of one bfloat16 step (≈ 4e-3 of
    the weights' scale)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from fsdp_families import check

    threads = torch.get_num_threads()
    try:
        assert check("wan", "bfloat16") < 1e-3
    finally:  # the check's one-process update runs here at 1 thread: later tests compare against
        torch.set_num_threads(threads)  # runs in subprocesses at this process's count
