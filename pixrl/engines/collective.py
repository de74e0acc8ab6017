"""How the ranks of one update agree: a single process (nothing to agree on), or a
torch.distributed group (gloo on CPU, NCCL on GPU) whose ranks each replay a share of every
optimizer step's micro-batches.

Data parallelism here is the gradient all-reduce that DDP performs, done once per optimizer step
instead of through DDP's module wrapper: an algorithm's loss runs many forwards per backward
(one per stored step, the reference's without gradient) through the family's own call sites,
and a rank may hold no micro-batch of a step — neither fits DDP's one-forward-per-backward
reducer. Each rank sums ∇(loss / n_terms) over its micro-batches with the step's global n_terms;
summing those sums over the ranks gives the single-process gradient, so clipping and the
optimizer step are the same on every rank and the ranks never drift apart.

Sharded (FSDP, engines/fsdp.py), the summing is the backward's own reduce-scatter, and the ranks
must run the same sequence of forwards and backwards: a rank short of micro-batches in a step
replays the step's first one with weight 0 (its gradient and metrics count for nothing).
"""

from __future__ import annotations

from datetime import timedelta

import torch

BUCKET_ELEMENTS = 8 * 1024 * 1024  # all-reduce in buckets of up to 8M elements of one dtype


class SingleProcess:
    rank, world = 0, 1

    def share(self, step_batches: list) -> list[tuple[int, list, float]]:
        """(index, micro-batch, weight) of what this rank replays of an optimizer step."""
        return [(j, mb, 1.0) for j, mb in enumerate(step_batches)]

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        pass

    def gather(self, obj) -> list:
        return [obj]

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


class TorchDistributed:
    """This process's rank in an initialised process group."""

    def __init__(self, rank: int, world: int, sharded: bool = False):
        self.rank, self.world, self.sharded = rank, world, sharded

    @classmethod
    def join(cls, rank: int, world: int, master: str, backend: str, timeout_s: float = 300.0,
             sharded: bool = False) -> "TorchDistributed":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        return cls(rank, world, sharded)

    def share(self, step_batches: list) -> list[tuple[int, list, float]]:
        """Every world-th micro-batch, starting at this rank's; sharded, padded to the same
        count on every rank with weight-0 replays of the step's first micro-batch."""
        mine = [(j, mb, 1.0) for j, mb in enumerate(step_batches)][self.rank::self.world]
        if self.sharded and step_batches:
            mine += [(0, step_batches[0], 0.0)] * (-(-len(step_batches) // self.world) - len(mine))
        return mine

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients over the ranks (a parameter without a gradient counts as zeros);
        sharded, the backward's reduce-scatter has summed the shards' already, and only the
        parameters left whole (in no FSDP unit) are summed here."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        if self.sharded:
            params = [p for p in params if not isinstance(p, DTensor)]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            bucket, size = [], 0
            for p in group + [None]:
                if p is not None and (size + p.grad.numel() <= BUCKET_ELEMENTS or not bucket):
                    bucket.append(p)
                    size += p.grad.numel()
                    continue
                if bucket:
                    flat = torch.cat([q.grad.reshape(-1) for q in bucket])
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                    offset = 0
                    for q in bucket:
                        q.grad.copy_(flat[offset:offset + q.grad.numel()].view_as(q.grad))
                        offset += q.grad.numel()
                bucket, size = ([p], p.grad.numel()) if p is not None else ([], 0)

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """torch's clip_grad_norm_ over the (summed) gradients; sharded, over shards and whole
        gradients together: the squared norms of this rank's shards, summed over the ranks, plus
        those of the whole ones (equal on every rank), then the same clipping coefficient."""
        if not self.sharded:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return 0.0
        device = grads[0].device
        shards = [g.to_local() for g in grads if isinstance(g, DTensor)]
        whole = [g for g in grads if not isinstance(g, DTensor)]
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for g in shards:
            sq = sq + g.float().pow(2).sum()
        dist.all_reduce(sq, op=dist.ReduceOp.SUM)
        for g in whole:
            sq = sq + g.float().pow(2).sum()
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.item() if isinstance(g, DTensor) else coef.to(g.dtype))
        return float(total)

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
