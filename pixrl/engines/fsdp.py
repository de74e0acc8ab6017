"""Fully sharded data parallel for a trainer group (`ray.trainer_sharding=fsdp`): the trained
module, and any frozen copy the update needs beside it, sharded over the ranks with torch's
`fully_shard` (FSDP2), so each rank holds 1/world of the weights, gradients and Adam moments.

Everything that leaves or enters a rank is full-sized and in the single-process format — the
weights of `TrainablePolicy.state()`, the optimizer state saved with a checkpoint — so an FSDP
run's checkpoint resumes on one process and the other way round.

What is sharded: each transformer block, then the rest of the module (its root), for a family
whose calls all go through the module's forward (the diffusion families). A family that calls
the module's parts directly (Janus-Pro: embeddings, heads, the language model's layers) names
those parts (`Family.fsdp_units`); the root is then not wrapped, and trainable parameters in no
part (a final norm) stay whole on every rank with their gradients all-reduced, as under DDP.

The ranks must call the sharded modules in lockstep (every forward all-gathers, every backward
reduce-scatters): the update pads a rank's share of an optimizer step with zero-weighted
replays of the step's first micro-batch (`collective.TorchDistributed.share`). The gradient
reduce-scatter sums (divide factor 1), as the data-parallel all-reduce does: each rank already
divides by the step's global term count.
"""

from __future__ import annotations

import sys

import torch


def _sharded(t: torch.Tensor) -> bool:
    """Whether `t` is a DTensor (a shard). torch.distributed.tensor is not imported for this: it
    costs ≈ 1.5 s of a run's start-up, and until something imports it (sharding does) no tensor
    can be one."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The units sharded one by one (each gathered only while it computes): the entries of the
    outermost ModuleLists — a DiT's transformer blocks, a language model's layers (not the lists
    inside a block, such as an attention's output projection)."""
    out = []
    for child in module.children():
        if isinstance(child, torch.nn.ModuleList):
            out.extend(m for m in child if any(True for _ in m.parameters()))
        else:
            out.extend(blocks(child))
    return out


def shard_module(module: torch.nn.Module, device_type: str, units=None) -> torch.nn.Module:
    """Shard `module` in place over the default process group: each block, then the rest — or,
    given `units(module)`, exactly those parts (the family calls them directly)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import torch.distributed as dist

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for unit in (untied(units(module)) if units else [*blocks(module), module]):
        fully_shard(unit, mesh=mesh)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)  # the ranks' gradients are summed, not averaged
            sub.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return module


def untied(parts: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The parts that share no parameter with another part. Parts tied together (an embedding
    and an output head with one weight) stay whole on every rank, their gradients all-reduced:
    sharded apart a tied weight would become two, and FSDP cannot make them one unit when the
    family calls them outside a common root's forward."""
    ids = [{id(p) for p in part.parameters()} for part in parts]
    return [part for i, part in enumerate(parts) if not any(ids[i] & other for k, other in enumerate(ids) if k != i)]


def local_bytes(tensors) -> int:
    """Bytes this rank holds of these tensors (of a sharded one: its shard)."""
    return sum((t.to_local() if _sharded(t) else t).nbytes for t in tensors)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a shard: every rank must call it)."""
    return t.full_tensor() if _sharded(t) else t


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A full tensor laid out as `param` is: this rank's shard of it, for a sharded parameter
    (every rank holds the whole value, so no data moves)."""
    value = value.to(device=param.device, dtype=param.dtype)
    if _sharded(param):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value


def full_optimizer_state(state: dict) -> dict:
    """An optimizer state_dict with every sharded moment gathered whole: the single-process format."""
    return {**state, "state": {i: {k: full(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                               for i, s in state["state"].items()}}


def sharded_optimizer_state(state: dict, params: list[torch.nn.Parameter]) -> dict:
    """A single-process optimizer state_dict laid out for sharded parameters (per-parameter
    tensors of the parameter's shape become its shards; scalars such as `step` stay)."""
    out = {}
    for i, s in state["state"].items():
        p = params[int(i)]
        out[i] = {k: like(v, p) if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) else v
                  for k, v in s.items()}
    return {**state, "state": out}
