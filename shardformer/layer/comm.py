"""Autograd-aware collectives for Megatron-style tensor parallelism.

Each op is the identity when the group has one rank (or torch.distributed is not initialized).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = [
    "get_tp_world_size",
    "get_tp_rank",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "split_to_tp",
]


def get_tp_world_size(group: ProcessGroup | None) -> int:
    """Number of ranks in `group`; 1 when torch.distributed is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def get_tp_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside `group`; 0 when torch.distributed is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _all_reduce(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Sum over the group, in place when `x` is contiguous (callers pass tensors no one else holds)."""
    out = x.contiguous()
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _own_chunk(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    world = dist.get_world_size(group)
    if x.size(dim) % world:
        raise ValueError(f"size {x.size(dim)} along dim {dim} is not divisible by the group size {world}")
    step = x.size(dim) // world
    return x.narrow(dim, dist.get_rank(group) * step, step).contiguous()


class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        # A copy: autograd may hand the same gradient tensor to other branches (e.g. through a view or an add).
        return _all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce (sum). Backward: identity."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        # in place when possible: x is a fresh partial result (a row-parallel matmul's output) that only this op reads
        out = _all_reduce(x, group)
        if out is x:
            ctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: all-gather and concatenate along `dim`. Backward: keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _own_chunk(grad, ctx.dim, ctx.group), None, None


class _SplitToTP(torch.autograd.Function):
    """Forward: keep this rank's chunk along `dim`. Backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _own_chunk(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Enter a TP region: identity forward, gradient summed over the group."""
    return x if get_tp_world_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Leave a TP region by summing partial results over the group; gradient passes through."""
    return x if get_tp_world_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's shard along `dim`; the gradient is split back."""
    return x if get_tp_world_size(group) == 1 else _GatherFromTP.apply(x, dim, group)


def split_to_tp(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Keep this rank's equal chunk along `dim`; the gradient is gathered back."""
    return x if get_tp_world_size(group) == 1 else _SplitToTP.apply(x, dim, group)
