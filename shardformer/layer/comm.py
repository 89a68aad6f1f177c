"""Autograd-aware collectives for Megatron-style tensor parallelism and sequence parallelism over the tp group.

Each op is the identity when the group has one rank (or torch.distributed is not initialized). The sequence ops use
torch's single-tensor collectives (`all_gather_tensor`, `reduce_scatter_tensor` below, `all_to_all_single`; gloo has
all three) on a copy with the split dimension moved first.

`all_gather_tensor` / `reduce_scatter_tensor` are torch's `all_gather_into_tensor` / `reduce_scatter_tensor`
(torch >= 1.13; the only names torch 2.11 has), called by the names torch 2.13 gave them (`all_gather_single` /
`reduce_scatter_single`, where the old names warn as deprecated) wherever torch has those. Same arguments, same
semantics.

Sums over the tp group (`start_sum`) of up to 2 MiB on gloo with a power-of-two group exchange whole tensors with
one partner per round (recursive doubling: one round for tp=2) and add: on CPU such an all-reduce is latency bound,
and this is one send/receive per round where gloo's ring takes two steps per peer (measured 0.74 vs 1.0 ms for
1 MiB on two ranks). Larger tensors are bandwidth bound, where gloo's ring moves half as much per rank (measured at
two ranks: equal at 2 MiB, 4 MiB 3.2 vs 6.3 ms, 25 MiB 18.9 vs 23.6 ms), so they all-reduce, as other backends
(NCCL) always do. Every rank ends with the same bits (IEEE addition commutes: a + b == b + a).

Under torch.compile (regional compilation) the public autograd ops below run comm_traced.py's versions instead:
the same collectives through torch's functional collectives, which dynamo traces into the compiled graph.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from . import comm_traced as traced

__all__ = [
    "get_tp_world_size",
    "get_tp_rank",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "split_to_tp",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "all_to_all",
    "all_gather_along",
    "all_gather_tensor",
    "reduce_scatter_tensor",
    "start_sum",
    "PendingSum",
]


_SINGLE_NAMES = hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single")


def all_gather_tensor(output: Tensor, input: Tensor, group: ProcessGroup | None = None, async_op: bool = False):
    """`output` (world * n elements along dim 0) <- every rank's `input` (n), in rank order. Looked up on
    `torch.distributed` at each call, so that a wrapper installed there (a communication counter) sees it."""
    if _SINGLE_NAMES:
        return dist.all_gather_single(output, input, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output: Tensor, input: Tensor, group: ProcessGroup | None = None, async_op: bool = False):
    """`output` (n) <- this rank's chunk (dim 0) of the sum over the group of every rank's `input` (world * n)."""
    if _SINGLE_NAMES:
        return dist.reduce_scatter_single(output, input, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(output, input, group=group, async_op=async_op)


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


class PendingSum:
    """A sum over the group in flight (`start_sum`); `wait()` returns it."""

    def __init__(self, x: Tensor, group: ProcessGroup | None, in_place: bool) -> None:
        self.group, self._out, self._work = group, x.contiguous(), None
        self._owned = in_place or self._out is not x  # may the sum overwrite `_out`?
        self._partners = _exchange_partners(group, self._out.numel() * self._out.element_size())
        if self._partners is None:  # one all-reduce (on a copy unless in place)
            if not self._owned:
                self._out, self._owned = self._out.clone(), True
            self._work = dist.all_reduce(self._out, group=group, async_op=True)
        else:
            self._exchange(self._partners[0])

    def _exchange(self, peer: int) -> None:
        self._buf = torch.empty_like(self._out)
        self._work = (dist.isend(self._out, group=self.group, group_dst=peer),
                      dist.irecv(self._buf, group=self.group, group_src=peer))

    def _add(self) -> None:
        send, recv = self._work
        recv.wait()
        send.wait()
        if self._owned:
            self._out.add_(self._buf)
        else:  # the received buffer is ours: keep the caller's tensor untouched
            self._out, self._owned = self._buf.add_(self._out), True
        self._buf = None

    def wait(self) -> Tensor:
        if self._partners is None:
            self._work.wait()
            return self._out
        self._add()
        for peer in self._partners[1:]:
            self._exchange(peer)
            self._add()
        return self._out


_EXCHANGE_MAX_BYTES = 2 << 20


def _exchange_partners(group: ProcessGroup | None, nbytes: int) -> list[int] | None:
    """Group ranks this rank exchanges with, round by round (recursive doubling), for gloo, a power-of-two group
    and at most 2 MiB; None: all-reduce instead."""
    world = dist.get_world_size(group)
    if world & (world - 1) or nbytes > _EXCHANGE_MAX_BYTES or dist.get_backend(group) != "gloo":
        return None
    rank = dist.get_rank(group)
    return [rank ^ (1 << k) for k in range(world.bit_length() - 1)]


def start_sum(x: Tensor, group: ProcessGroup | None, in_place: bool = False) -> PendingSum:
    """Start summing `x` over the group; `in_place`: `x` (contiguous) may hold the result. The result is a new
    tensor otherwise (x is left untouched). Every rank of the group must call it, in the same order."""
    return PendingSum(x, group, in_place)


def _all_reduce(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Sum over the group, in place when `x` is contiguous (callers pass tensors no one else holds)."""
    return start_sum(x, group, in_place=True).wait()


def _divisible(x: Tensor, dim: int, group: ProcessGroup | None) -> int:
    """The group's size, which must divide x's size along `dim`."""
    world = dist.get_world_size(group)
    if x.size(dim) % world:
        raise ValueError(f"size {x.size(dim)} along dim {dim} is not divisible by the group size {world}")
    return world


def _own_chunk(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    step = x.size(dim) // _divisible(x, dim, group)
    # a copy: a contiguous narrow is a view that would keep the whole tensor's storage alive for backward
    return x.narrow(dim, dist.get_rank(group) * step, step).clone(memory_format=torch.contiguous_format)


def all_gather_along(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Concatenation along `dim` of every rank's `x` (no autograd): one `all_gather_tensor`."""
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((dist.get_world_size(group) * src.shape[0], *src.shape[1:]))
    all_gather_tensor(out, src, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_along(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """This rank's chunk along `dim` of the sum over the group: one `reduce_scatter_tensor`."""
    world = _divisible(x, dim, group)
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] // world, *src.shape[1:]))
    reduce_scatter_tensor(out, src, group=group)
    return out.movedim(0, dim).contiguous()


def _all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None) -> Tensor:
    """Rank r sends its j-th chunk along `scatter_dim` to rank j and concatenates what it receives along
    `gather_dim`: one `all_to_all_single`."""
    world = _divisible(x, scatter_dim, group)
    src = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    out = torch.empty_like(src)
    dist.all_to_all_single(out, src, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim)


class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        # not in place: autograd may hand the same gradient tensor to other branches (e.g. through a view or an add)
        return start_sum(grad, ctx.group).wait(), None


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


class _AlongDim(torch.autograd.Function):
    """Forward: `forward_op(x, dim, group)`. Backward: its adjoint `backward_op(grad, dim, group)` (gather / keep own
    chunk, all-gather / reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup | None, forward_op, backward_op) -> Tensor:
        ctx.dim, ctx.group, ctx.backward_op = dim, group, backward_op
        return forward_op(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.backward_op(grad, ctx.dim, ctx.group), None, None, None, None


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all from `scatter_dim` to `gather_dim`. Backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None) -> Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def copy_to_tp(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Enter a TP region: identity forward, gradient summed over the group."""
    if get_tp_world_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return traced.copy_to_tp(x, group)
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Leave a TP region by summing partial results over the group; gradient passes through."""
    if get_tp_world_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return traced.reduce_from_tp(x, group)
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's shard along `dim`; the gradient is split back."""
    if get_tp_world_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return traced.gather_from_tp(x, dim, group)
    return _AlongDim.apply(x, dim, group, all_gather_along, _own_chunk)


def split_to_tp(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Keep this rank's equal chunk along `dim`; the gradient is gathered back."""
    if get_tp_world_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return traced.split_to_tp(x, dim, group)
    return _AlongDim.apply(x, dim, group, _own_chunk, all_gather_along)


def gather_from_sequence(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Enter a tp region from a sequence shard (split_gather sequence parallelism): the full sequence, gathered
    along `dim`; the gradient is reduce-scattered back to the shards."""
    if get_tp_world_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return traced.gather_from_sequence(x, dim, group)
    return _AlongDim.apply(x, dim, group, all_gather_along, _reduce_scatter_along)


def reduce_scatter_to_sequence(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Leave a tp region into a sequence shard: partial results summed over the group, each rank keeping its chunk
    along `dim`; the gradient is all-gathered."""
    if get_tp_world_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return traced.reduce_scatter_to_sequence(x, dim, group)
    return _AlongDim.apply(x, dim, group, _reduce_scatter_along, all_gather_along)


def all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None) -> Tensor:
    """Exchange chunks: split along `scatter_dim`, concatenate along `gather_dim` (Ulysses: heads for sequence);
    the gradient takes the reverse exchange."""
    if get_tp_world_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return traced.all_to_all(x, scatter_dim, gather_dim, group)
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)
