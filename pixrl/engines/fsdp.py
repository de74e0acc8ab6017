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
part (a final norm) stay whole on every rank with their gradients all-reduced, as under DDP —
as do a unit's trainable parameters outside its main dtype (`odd_dtype`).

Start-up never holds the whole trained module on a trainer's device, nor more than one host
copy of it on a node: rank 0 loads it into host memory, the other ranks build it on the meta
device (shapes only, no storage); every rank shards its skeleton, allocates its own shards on
the device, and receives them from rank 0 (`materialize`). The frozen copies are skeletons too,
filled from the trained module's shards without communication.

The ranks must call the sharded modules in lockstep (every forward all-gathers, every backward
reduce-scatters): the update pads a rank's share of an optimizer step with zero-weighted
replays of the step's first micro-batch (`collective.TorchDistributed.share`). The gradient
reduce-scatter sums (divide factor 1), as the data-parallel all-reduce does: each rank already
divides by the step's global term count.
"""

from __future__ import annotations

import copy
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
    placed: set[int] = set()  # parameters of units already sharded (a later, outer unit skips them)
    for unit in (untied(units(module)) if units else [*blocks(module), module]):
        own = [p for p in unit.parameters() if id(p) not in placed]
        fully_shard(unit, mesh=mesh, ignored_params=odd_dtype(own) or None)
        placed |= {id(p) for p in own}
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)  # the ranks' gradients are summed, not averaged
            sub.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return module


def skeleton(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` whose parameters and buffers are on the meta device (ties kept): the
    structure of a frozen copy, without a second set of weights in memory."""
    memo = {}
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in memo:
            empty = torch.empty_like(t, device="meta")
            memo[id(t)] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
    return copy.deepcopy(module, memo)


def loose_buffers(module: torch.nn.Module) -> list[str]:
    """Buffers that are not in the state dict (non-persistent: positional tables, rotary
    frequencies computed at construction). A meta-built module has none of their values, so
    they travel apart from the weights."""
    saved = set(module.state_dict())
    return [name for name, _ in module.named_buffers() if name not in saved]


def layout(module: torch.nn.Module) -> dict:
    """What the ranks of a group must agree on before sharding: each parameter's shape and
    dtype, and which names share one parameter (ties)."""
    params = {n: (tuple(p.shape), p.dtype) for n, p in module.named_parameters(remove_duplicate=False)}
    return {"params": params, "ties": ties(module)}


def ties(module: torch.nn.Module) -> list[list[str]]:
    """The names that share one parameter, group by group (an embedding and its tied head)."""
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return sorted(names for names in groups.values() if len(names) > 1)


def align(module: torch.nn.Module, what: str) -> None:
    """Make this rank's module — built from the config on another rank than 0 — match rank 0's
    loaded one: the same parameters and ties, or an error naming the first difference (ranks
    that disagree would hang in their first collective); rank 0's dtypes (a loader may keep
    some modules in float32 under a bfloat16 model, as `_keep_in_fp32_modules` asks)."""
    import torch.distributed as dist

    theirs = [layout(module) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(theirs, src=0)
    want, mine = theirs[0], layout(module)
    differ = [f"{n}, which rank 0 lacks" for n in sorted(set(mine["params"]) - set(want["params"]))] + \
        [f"no {n}" for n in sorted(set(want["params"]) - set(mine["params"]))] + \
        [f"{n} of shape {mine['params'][n][0]}, not {shape}" for n, (shape, _) in want["params"].items()
         if n in mine["params"] and mine["params"][n][0] != shape]
    if not differ and want["ties"] != mine["ties"]:
        differ = [f"tied parameters {mine['ties']}, not {want['ties']}"]
    if differ:
        raise RuntimeError(f"rank {dist.get_rank()} built the {what} unlike rank 0: it has {differ[0]}"
                           f"{f' (and {len(differ) - 1} more differences)' if len(differ) > 1 else ''}; "
                           f"every rank must load the same checkpoint and model settings")
    with torch.no_grad():
        for name, param in module.named_parameters():
            dtype = want["params"][name][1]
            if param.dtype != dtype:
                param.data = param.data.to(dtype)


def allocate(module: torch.nn.Module, device: torch.device) -> None:
    """`to_empty` with tied parameters kept tied: moving off the meta device makes a new
    Parameter per module that holds it, so an embedding and its tied head would come apart."""
    tied = ties(module)
    module.to_empty(device=device)
    for first, *others in tied:
        shared = module.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, shared)


def materialize(module: torch.nn.Module, device: torch.device, source: dict[str, torch.Tensor]) -> None:
    """Give a sharded module (meta or not) this rank's storage on `device` and rank 0's values:
    `source` (rank 0: the full state dict taken before sharding; others: {}) is broadcast into
    each rank's shards, and the loose buffers are broadcast whole — in rank 0's shapes and
    dtypes, which a skeleton built from the config need not share."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank0 = dist.get_rank() == 0
    held = dict(module.named_buffers())
    buffers = {n: held[n].detach().clone() for n in loose_buffers(module)} if rank0 else {}  # before to_empty
    allocate(module, device)
    set_model_state_dict(module, dict(source), options=StateDictOptions(full_state_dict=True,
                                                                        broadcast_from_rank0=True))
    shapes = [{n: (tuple(b.shape), b.dtype) for n, b in buffers.items()} if rank0 else None]
    dist.broadcast_object_list(shapes, src=0)
    for name, (shape, dtype) in shapes[0].items():
        value = buffers[name].to(device) if rank0 else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(value, src=0)
        _put_buffer(module, name, value, persistent=False)


def fill_like(module: torch.nn.Module, source: torch.nn.Module) -> None:
    """Allocate a sharded skeleton of `source` and copy `source`'s values into it, shard for
    shard, so no data moves between ranks; its buffers are copies of `source`'s (rank 0's)."""
    saved = set(module.state_dict())
    allocate(module, next(source.parameters()).device)
    theirs = dict(source.named_parameters())
    with torch.no_grad():
        for name, t in module.named_parameters():  # a frozen copy shards what the trained module
            t.copy_(like(theirs[name], t))  # keeps whole in another dtype (`odd_dtype`): no data moves
    for name, b in source.named_buffers():
        _put_buffer(module, name, b.detach().clone(), persistent=name in saved)


def _put_buffer(module: torch.nn.Module, name: str, value: torch.Tensor, persistent: bool) -> None:
    owner, _, leaf = name.rpartition(".")
    module.get_submodule(owner).register_buffer(leaf, value, persistent=persistent)


def odd_dtype(params: list[torch.nn.Parameter]) -> set[torch.nn.Parameter]:
    """The trainable parameters of a unit not in its main dtype (the one most of its trainable
    elements have). FSDP reduce-scatters one dtype per unit, and loaders keep some modules in
    float32 under a bfloat16 model (Wan's norms and modulation tables): those stay whole on
    every rank, their gradients all-reduced as under DDP (`collective.reduce_gradients`)."""
    sizes: dict[torch.dtype, int] = {}
    for p in params:
        if p.requires_grad:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if len(sizes) < 2:
        return set()
    main = max(sizes, key=sizes.get)
    return {p for p in params if p.requires_grad and p.dtype != main}


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


def like(value: torch.Tensor, param: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A full tensor laid out as `param` is: this rank's shard of it, for a sharded parameter
    (every rank holds the whole value, so no data moves); in `param`'s dtype unless `dtype`."""
    if _sharded(value):  # already a shard of a parameter laid out as this one (the base weights)
        return value
    value = value.to(device=param.device, dtype=dtype or param.dtype)
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
