"""Replicated parameters whose gradients are summed over the tp group, and key/value projections when tp is larger than the number of key/value heads (GQA): the projection stays whole
on every rank (it is small) and each rank keeps the head its query heads attend to; the gradients of the replicas
are summed over the tp group (each rank's gradient is non-zero only in the rows of its head), which is exact."""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .comm import copy_to_tp, get_tp_rank, get_tp_world_size, start_sum

__all__ = ["sum_grads_over_tp", "sum_grad_over_tp", "keep_own_head", "sum_tail_grad_over_tp"]


def sum_grad_over_tp(param: Tensor, group: ProcessGroup | None) -> None:
    """Each use's gradient of `param` is summed over the group before it is accumulated (so the per-microbatch sums
    add up): for a replicated parameter that sees only this rank's part of a split activation. Once per parameter and
    group (a second call does nothing; a parameter split over tp rows and sequence over sp is summed over each); the
    groups in `param._grad_summed_over` tell a parameter re-created later (lazy initialization) to get the hooks
    again."""
    summed = getattr(param, "_grad_summed_over", ())
    if any(g is group for g in summed) or get_tp_world_size(group) == 1 or not param.requires_grad:
        return  # (a frozen parameter, e.g. a LoRA base weight, has no gradient to sum)
    param.register_hook(functools.partial(_summed, group=group))
    param._grad_summed_over = (*summed, group)


def sum_grads_over_tp(module: nn.Module, group: ProcessGroup | None) -> None:
    """`sum_grad_over_tp` for each of the module's parameters."""
    for p in module.parameters():
        sum_grad_over_tp(p, group)


def _summed(grad: Optional[Tensor], group: ProcessGroup) -> Optional[Tensor]:
    """A use's gradient summed over the group (a new tensor: the hook's gradient may be shared with other uses).
    None (a zero-bubble input-gradient pass, I, left a linear layer's weight gradient to W): nothing to sum now; W
    accumulates it through autograd later, which calls this hook with it, in the same order on every rank."""
    return None if grad is None else start_sum(grad, group).wait()


def _narrow(start: int, size: int, module: nn.Module, args, out: Tensor) -> Tensor:
    return out.narrow(-1, start, size)


def keep_own_head(module: nn.Module, num_heads: int, group: ProcessGroup | None) -> None:
    """`module`'s output holds `num_heads` equal heads; rank r of the group keeps head r // (tp / num_heads)."""
    world, rank = get_tp_world_size(group), get_tp_rank(group)
    if world % num_heads:
        raise ValueError(f"tp_size={world} is not a multiple of the {num_heads} key/value heads of {module}.")
    out_features = module.weight.shape[0]
    head_dim = out_features // num_heads
    module.region_input = None  # like a column layer: its input gradient covers this rank's head only
    module.register_forward_pre_hook(functools.partial(_copied_input, group))
    module.register_forward_hook(functools.partial(_narrow, rank // (world // num_heads) * head_dim, head_dim))
    sum_grads_over_tp(module, group)


def _copied_input(group: ProcessGroup | None, module: nn.Module, args):
    """The input's gradient summed over the group: the region's shared copy when it reads exactly the region's
    input (see region.RegionInput), else its own copy."""
    x, region = args[0], module.region_input
    return (region.copied() if region is not None and region.holds(x) else copy_to_tp(x, group), *args[1:])


def _tail_copied(features: int, group: ProcessGroup | None, module: nn.Module, args, out: Tensor) -> Tensor:
    head, tail = out.split([out.shape[-1] - features, features], dim=-1)
    return torch.cat([head, copy_to_tp(tail, group)], dim=-1)


def sum_tail_grad_over_tp(module: nn.Module, features: int, group: ProcessGroup | None) -> None:
    """The last `features` features of `module`'s (replicated) output feed every rank's heads alike: their gradient,
    each rank's from its own heads, is summed over the group (identity forward)."""
    module.register_forward_hook(functools.partial(_tail_copied, features, group))
