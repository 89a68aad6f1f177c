"""Column layers' weight gradients computed while their input gradient is being summed over the tp group.

In backward, a tp region's entry (layer/region.py) sums the input gradient of its column layers (q, k, v; gate, up)
over the group. Autograd would compute each layer's weight gradient in the layer's own backward, before that sum
starts, and then wait for the sum with nothing to do. Here the layers' backward computes the input gradient only
and leaves input and output gradient in the region entry's WeightGradStore (pipeline/split_backward.py, the same
store zbv's W uses); the entry's backward starts the sum, computes the weight (and bias) gradients, then waits
(Megatron-LM's overlap of the input-gradient all-reduce with the weight-gradient GEMM, once per region instead of
once per layer).

The weight gradients still leave through autograd (the entry's backward returns them), so they accumulate into
`.grad` as usual and post-accumulate hooks (data-parallel buckets, ZeRO) fire.

Schedules that split the backward themselves (zbv: input gradients now, weight gradients later, by
pipeline/split_backward.py) turn this off and route every linear layer through that split instead
(layer/split_weight_grads.py).

Compiled layers (regional compilation) do not defer: the store is Python state their backward graph cannot hold,
and the compiled backward schedules the weight-gradient matmuls and the sum itself.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from pipeline.split_backward import WeightGradStore

from .comm import start_sum

__all__ = ["Deferring", "enter_deferring"]


class _EnterDeferring(torch.autograd.Function):
    """Forward: identity on the region input. Backward: start summing the input gradient over the group, compute
    the weight gradients the layers left in `store` meanwhile, then wait for the sum."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Optional[ProcessGroup], store: WeightGradStore, *params: Tensor) -> Tensor:
        ctx.group, ctx.store, ctx.params = group, store, params
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        pending = start_sum(grad, ctx.group) if ctx.needs_input_grad[0] else None
        taken = ctx.store.take()
        param_grads = [taken[id(p)][1] if id(p) in taken else None for p in ctx.params]
        return (pending.wait() if pending is not None else None, None, None, *param_grads)


class Deferring(NamedTuple):
    """A region entry's deferring layers and the store their backward leaves weight gradients in."""
    layers: Tuple[nn.Module, ...]
    store: WeightGradStore


def enter_deferring(x: Tensor, group: Optional[ProcessGroup], layers: Sequence[nn.Module]
                    ) -> Tuple[Tensor, Optional[Deferring]]:
    """The region input as its column layers read it, and those of `layers` that defer (trainable weights,
    gradients enabled) with their store; None when none does (then the caller enters the region plainly)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():  # compiled: the graph orders the work itself
        return x, None
    deferring = tuple(m for m in layers if getattr(m, "defer_weight_grad", False) and m.weight.requires_grad
                      and (m.bias is None or m.bias.requires_grad))
    if not deferring:
        return x, None
    store = WeightGradStore()
    params = [p for layer in deferring for p in (layer.weight, layer.bias) if p is not None]
    return _EnterDeferring.apply(x, group, store, *params), Deferring(deferring, store)
