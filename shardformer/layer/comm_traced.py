"""The tp and sequence collectives of layer/comm.py as dynamo traces them, for code running under torch.compile
(regional compilation, booster_plugin/core/regional_compile.py): torch's functional collectives
(`torch.distributed._functional_collectives`), which dynamo records in the graph and inductor runs as collective
kernels, so a compiled decoder layer is one graph instead of the pieces between our eager collectives.

Same semantics as the eager ops (forward and backward): where torch's autograd variant has our backward
(all-gather <-> reduce-scatter, all-to-all <-> the reverse all-to-all) it is used as it is; the others (an
identity forward with a summed gradient, a sum with an identity backward, a gather whose gradient is split back)
are autograd.Functions whose forward and backward call the functional collectives, which dynamo traces both of.
Gloo runs all of them on CPU (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single).
The eager path stays comm.py's (the exchange-based sum on gloo, in-place reductions): these functions are
called only while compiling (comm.py dispatches on `torch.compiler.is_compiling()`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_from_tp", "split_to_tp", "gather_from_sequence",
           "reduce_scatter_to_sequence", "all_to_all"]

# torch 2.13 names the single-tensor functional collectives `*_single*` (the older names warn as deprecated)
_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_scatter_autograd = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _world(group: ProcessGroup | None) -> ProcessGroup:
    return dist.group.WORLD if group is None else group


def _sum(x: Tensor, group: ProcessGroup) -> Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))


def _gather_along(x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
    return funcol.wait_tensor(_gather(x.contiguous(), dim % x.dim(), group))


def _own_chunk(x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
    world = dist.get_world_size(group)
    if x.size(dim) % world:
        raise ValueError(f"size {x.size(dim)} along dim {dim} is not divisible by the group size {world}")
    return x.chunk(world, dim=dim)[dist.get_rank(group)].contiguous()


class _Copy(torch.autograd.Function):
    """Forward: identity. Backward: the gradient summed over the group."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _sum(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    """Forward: the sum over the group. Backward: identity."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup) -> Tensor:
        return _sum(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _Gather(torch.autograd.Function):
    """Forward: every rank's `x` concatenated along `dim`. Backward: this rank's chunk of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _own_chunk(grad, ctx.dim, ctx.group), None, None


class _Split(torch.autograd.Function):
    """Forward: this rank's chunk along `dim`. Backward: the gradient gathered along `dim`."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _own_chunk(x, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather_along(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x: Tensor, group: ProcessGroup | None) -> Tensor:
    return _Copy.apply(x, _world(group))


def reduce_from_tp(x: Tensor, group: ProcessGroup | None) -> Tensor:
    return _Reduce.apply(x, _world(group))


def gather_from_tp(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    return _Gather.apply(x, dim, _world(group))


def split_to_tp(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    return _Split.apply(x, dim, _world(group))


def gather_from_sequence(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """All-gather along `dim`; backward: reduce-scatter (torch's autograd all-gather)."""
    group = _world(group)
    return funcol.wait_tensor(_gather_autograd(x.contiguous(), dim % x.dim(), group))


def reduce_scatter_to_sequence(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Reduce-scatter (sum) along `dim`; backward: all-gather (torch's autograd reduce-scatter)."""
    group = _world(group)
    world = dist.get_world_size(group)
    if x.size(dim) % world:
        raise ValueError(f"size {x.size(dim)} along dim {dim} is not divisible by the group size {world}")
    return funcol.wait_tensor(_scatter_autograd(x.contiguous(), "sum", dim % x.dim(), group))


def all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None) -> Tensor:
    """Chunk j along `scatter_dim` to rank j, received chunks concatenated along `gather_dim`; backward: the reverse
    exchange (torch's autograd all_to_all_single on the stacked chunks)."""
    group = _world(group)
    world = dist.get_world_size(group)
    if x.size(scatter_dim) % world:
        raise ValueError(f"size {x.size(scatter_dim)} along dim {scatter_dim} is not divisible by the group size "
                         f"{world}")
    src = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    out = funcol.wait_tensor(funcol.all_to_all_single_autograd(src, None, None, group))
    return torch.cat(out.unbind(0), dim=gather_dim)
