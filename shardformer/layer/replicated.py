"""Replicated parameters whose gradients are summed over the tp group, and projections kept whole whose output each
rank narrows to its own heads: key/value projections when tp is larger than the number of key/value heads (GQA; each
rank keeps the head its query heads attend to), and multi-query attention's fused projection ([all query heads, one
key, one value]: each rank keeps its query heads and the key and value). The projection stays whole on every rank;
the gradients of the replicas are summed over the tp group (each rank's is non-zero only in the rows of its heads,
and partial, from its own heads, in the rows of a key/value every rank uses), which is exact."""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from pipeline.context import Axis

from .comm import copy_to_tp, get_tp_world_size, start_sum
from .region import RegionSlot, join_region
from .tensor_registry import tensor_registry

__all__ = ["sum_grads_over_tp", "sum_grad_over_tp", "grad_summed_over", "keep_own_heads", "sum_tail_grad_over_tp"]

# parameter -> the groups its gradient hooks sum over (layer/tensor_registry.py)
_SUMMED_OVER = tensor_registry()


def sum_grad_over_tp(param: Tensor, group: ProcessGroup | None) -> None:
    """Each use's gradient of `param` is summed over the group before it is accumulated (so the per-microbatch sums
    add up): for a replicated parameter that sees only this rank's part of a split activation. Once per parameter and
    group (a second call does nothing; a parameter split over tp rows and sequence over sp is summed over each); the
    groups, `grad_summed_over(param)`, tell a parameter re-created later (lazy initialization) to get the hooks
    again."""
    summed = grad_summed_over(param)
    if any(g is group for g in summed) or get_tp_world_size(group) == 1 or not param.requires_grad:
        return  # (a frozen parameter, e.g. a LoRA base weight, has no gradient to sum)
    param.register_hook(functools.partial(_summed, group=group))
    _SUMMED_OVER[param] = (*summed, group)


def grad_summed_over(param: Tensor) -> Tuple[ProcessGroup | None, ...]:
    """The groups `param`'s gradient is summed over (`sum_grad_over_tp`), in the order they were added."""
    return _SUMMED_OVER.get(param, ())


def sum_grads_over_tp(module: nn.Module, group: ProcessGroup | None) -> None:
    """`sum_grad_over_tp` for each of the module's parameters."""
    for p in module.parameters():
        sum_grad_over_tp(p, group)


def _summed(grad: Optional[Tensor], group: ProcessGroup) -> Optional[Tensor]:
    """A use's gradient summed over the group (a new tensor: the hook's gradient may be shared with other uses).
    None (a zero-bubble input-gradient pass, I, left a linear layer's weight gradient to W): nothing to sum now; W
    accumulates it through autograd later, which calls this hook with it, in the same order on every rank."""
    return None if grad is None else start_sum(grad, group).wait()


def _narrow(start: int, size: int, tail: int, module: nn.Module, args, out: Tensor) -> Tensor:
    own = out.narrow(-1, start, size)
    return torch.cat([own, out.narrow(-1, out.shape[-1] - tail, tail)], dim=-1) if tail else own


def keep_own_heads(module: nn.Module, num_heads: int, tp: Axis, tail: int = 0) -> None:
    """`module`'s output holds `num_heads` equal heads, then `tail` features every rank uses whole: rank r of the
    tp axis keeps its num_heads / tp heads (with fewer heads than ranks, head r // (tp / num_heads)) and the tail."""
    world, rank, group = tp.size, tp.rank, tp.group
    if world % num_heads and num_heads % world:
        raise ValueError(f"tp_size={world} neither divides nor is a multiple of the {num_heads} heads of {module}: "
                         f"use a tp size that does.")
    head_dim = (module.weight.shape[0] - tail) // num_heads
    slot = join_region(module)  # like a column layer: its input gradient covers this rank's heads only
    module.register_forward_pre_hook(functools.partial(_copied_input, group, slot))
    kept = max(1, num_heads // world)
    module.register_forward_hook(functools.partial(_narrow, rank * num_heads // world * head_dim, kept * head_dim,
                                                   tail))
    sum_grads_over_tp(module, group)


def _copied_input(group: ProcessGroup | None, slot: RegionSlot, module: nn.Module, args):
    """The input's gradient summed over the group: the region's shared copy when it reads exactly the region's
    input (see region.RegionInput), else its own copy."""
    x, region = args[0], slot.region
    return (region.copied() if region is not None and region.holds(x) else copy_to_tp(x, group), *args[1:])


def _tail_copied(features: int, group: ProcessGroup | None, module: nn.Module, args, out: Tensor) -> Tensor:
    head, tail = out.split([out.shape[-1] - features, features], dim=-1)
    return torch.cat([head, copy_to_tp(tail, group)], dim=-1)


def sum_tail_grad_over_tp(module: nn.Module, features: int, group: ProcessGroup | None) -> None:
    """The last `features` features of `module`'s (replicated) output feed every rank's heads alike: their gradient,
    each rank's from its own heads, is summed over the group (identity forward)."""
    module.register_forward_hook(functools.partial(_tail_copied, features, group))
