"""Column layers' weight gradients computed while their input gradient is being summed over the tp group.

In backward, a tp region's entry (layer/region.py) sums the input gradient of its column layers (q, k, v; gate, up)
over the group. Autograd would compute each layer's weight gradient in the layer's own backward, before that sum
starts, and then wait for the sum with nothing to do. Here the layers' backward computes the input gradient only
and hands their output gradient to the region's entry, which starts the sum, computes the weight (and bias)
gradients, then waits (Megatron-LM's overlap of the input-gradient all-reduce with the weight-gradient GEMM, once per
region instead of once per layer).

The weight gradients still leave through autograd (the entry's backward returns them), so they accumulate into
`.grad` as usual and post-accumulate hooks (data-parallel buckets, ZeRO) fire.

Schedules that split the backward themselves (zbv: input gradients now, weight gradients later, by
pipeline/split_backward.py) turn this off and route every linear layer through that split instead
(`prepare_split_backward`).
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from pipeline.split_backward import linear, linear_param_grads

from .comm import start_sum

__all__ = ["DeferredWeightGrads", "enter_deferring", "deferred_linear", "prepare_split_backward"]


class DeferredWeightGrads:
    """The output gradients of a region's deferring layers, collected in backward until the region's entry runs.

    Args:
        layers: the column layers whose weight gradients the entry computes.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self._grads: Dict[int, Tensor] = {}

    def params(self) -> List[Tensor]:
        """The layers' parameters, in the order `compute` returns their gradients."""
        return [p for layer in self.layers for p in (layer.weight, layer.bias) if p is not None]

    def holds(self, layer: nn.Module) -> bool:
        return any(layer is m for m in self.layers)

    def add(self, layer: nn.Module, grad: Tensor) -> None:
        key = id(layer)
        self._grads[key] = grad if key not in self._grads else self._grads[key] + grad  # a layer called twice

    def compute(self, x: Tensor) -> List[Optional[Tensor]]:
        """Gradients of `params()` for the region input `x` (None for a layer that got no output gradient); the
        collected output gradients are released."""
        out: List[Optional[Tensor]] = []
        for layer in self.layers:
            grad = self._grads.pop(id(layer), None)
            weight = bias = None
            if grad is not None:
                weight, bias = linear_param_grads(x, grad, layer.is_conv1d, layer.bias is not None)
            out.append(weight)
            if layer.bias is not None:
                out.append(bias)
        return out


class _EnterDeferring(torch.autograd.Function):
    """Forward: identity on the region input. Backward: start summing the input gradient over the group, compute
    the deferred weight gradients meanwhile, then wait for the sum."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Optional[ProcessGroup], grads: DeferredWeightGrads, *params: Tensor) -> Tensor:
        ctx.group, ctx.grads = group, grads
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        pending = start_sum(grad, ctx.group) if ctx.needs_input_grad[0] else None
        param_grads = ctx.grads.compute(x)
        return (pending.wait() if pending is not None else None, None, None, *param_grads)


class _DeferredLinear(torch.autograd.Function):
    """`x @ W^T + b` (Conv1D: `x @ W + b`) whose backward returns the input gradient only and hands the output
    gradient to the region's DeferredWeightGrads (W and b come in detached; their gradients leave by the entry)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], layer: nn.Module,
                grads: DeferredWeightGrads) -> Tensor:
        ctx.save_for_backward(weight)
        ctx.layer, ctx.grads = layer, grads
        return F.linear(x, weight.t() if layer.is_conv1d else weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (weight,) = ctx.saved_tensors
        ctx.grads.add(ctx.layer, grad)
        grad_x = grad @ (weight.t() if ctx.layer.is_conv1d else weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None


def enter_deferring(x: Tensor, group: Optional[ProcessGroup], layers: Sequence[nn.Module]
                    ) -> tuple[Tensor, Optional[DeferredWeightGrads]]:
    """The region input as its column layers read it, and the DeferredWeightGrads of `layers` (those of them that
    defer: trainable weights, gradients enabled); None when none does (then the caller enters the region plainly)."""
    if not torch.is_grad_enabled():
        return x, None
    deferring = [m for m in layers if getattr(m, "defer_weight_grad", False) and m.weight.requires_grad
                 and (m.bias is None or m.bias.requires_grad)]
    if not deferring:
        return x, None
    grads = DeferredWeightGrads(deferring)
    return _EnterDeferring.apply(x, group, grads, *grads.params()), grads


def deferred_linear(x: Tensor, layer: nn.Module, grads: DeferredWeightGrads) -> Tensor:
    """The column layer's output on the entered region input `x`, its weight gradient deferred to the entry."""
    bias = layer.bias.detach() if layer.bias is not None else None
    return _DeferredLinear.apply(x, layer.weight.detach(), bias, layer, grads)


def prepare_split_backward(model: nn.Module) -> None:
    """For a schedule that splits the backward into I and W (pipeline/split_backward.py): column layers stop
    deferring to their region's entry, and plain nn.Linear / transformers Conv1D modules compute through the split's
    `linear` (the tp layers always do)."""
    from transformers.pytorch_utils import Conv1D

    from .linear import ColumnParallelLinear
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            module.defer_weight_grad = False
        elif type(module) in (nn.Linear, Conv1D):
            module.forward = functools.partial(_split_linear_forward, module, type(module) is Conv1D)


def _split_linear_forward(module: nn.Module, transposed: bool, x: Tensor) -> Tensor:
    return linear(x, module.weight, module.bias, transposed)
