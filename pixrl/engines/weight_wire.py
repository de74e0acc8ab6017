"""The wire both ends of a weight move to a vLLM server share (engines/vllm_weights.py sends,
engines/vllm_receiver.py receives inside vLLM): a process group of its own, and the tensors
packed into a few flat buffers.

Torch only — this module is imported in vLLM's environment too, where pixrl's dependencies are
absent.

- **Its own group.** A TCPStore that the sender hosts, under a prefix per session, and a
  ProcessGroupGloo (CPU) or ProcessGroupNCCL (CUDA) built on it directly: neither side's default
  process group (the trainer's DDP/FSDP group, vLLM's tensor-parallel one) is touched. The sender
  is rank 0; the server's workers follow it.
- **Packed.** Consecutive tensors of one dtype share a flat buffer of at most `chunk_bytes`
  (one larger than that goes alone), so a model of a few hundred tensors moves in a handful of
  broadcasts. Both ends derive the same plan from the names, dtypes and shapes the sender
  announces.
"""

from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
ACCEPTED = "accepted"  # the store key a worker sets once it has taken the session, before the rendezvous


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight move: {name!r} is not a torch dtype")
    return dtype


def chunk_plan(dtype_names: list[str], shapes: list[list[int]], chunk_bytes: int) -> list[list[int]]:
    """Indices of the tensors that travel together, in order: runs of one dtype, each at most
    `chunk_bytes` (a single larger tensor is a chunk of its own)."""
    plan: list[list[int]] = []
    size = 0
    for i, (dt, shape) in enumerate(zip(dtype_names, shapes)):
        nbytes = math.prod(shape) * dtype_named(dt).itemsize
        if plan and dtype_names[plan[-1][0]] == dt and size + nbytes <= chunk_bytes:
            plan[-1].append(i)
            size += nbytes
        else:
            plan.append([i])
            size = nbytes
    return plan


def pack(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """One flat buffer of the tensors' values, in order (all of one dtype)."""
    return torch.cat([t.detach().reshape(-1).to(device) for t in tensors])


def unpack(flat: torch.Tensor, shapes: list[list[int]]) -> list[torch.Tensor]:
    """Views of `flat` with `shapes`, in order."""
    sizes = [math.prod(s) for s in shapes]
    return [part.view(s) for part, s in zip(torch.split(flat, sizes), shapes)]


def store(host: str, port: int, world: int, master: bool, timeout_s: float) -> dist.TCPStore:
    """The session's rendezvous: hosted by the sender (port 0: a free one), joined by the workers."""
    return dist.TCPStore(host, port, world, master, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def group(kv: dist.Store, session: str, rank: int, world: int, backend: str, timeout_s: float):
    """The session's process group (rank 0: the sender); blocks until every rank has joined."""
    if backend not in BACKENDS:
        raise ValueError(f"weight move: backend {backend!r} is not one of {', '.join(BACKENDS)}")
    prefixed = dist.PrefixStore(f"pixrl-weights/{session}", kv)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world, opts)


def broadcast(pg, tensor: torch.Tensor) -> None:
    """From rank 0 to every rank, in place; returns once it has landed here."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
