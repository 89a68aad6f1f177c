"""Linear layers for a schedule that splits the backward into input (I) and weight (W) gradients itself
(pipeline/split_backward.py, zbv): column layers stop deferring their weight gradients to their region's entry
(layer/deferred.py), and plain nn.Linear / transformers Conv1D modules compute through the split's `linear` (the tp
layers always do)."""
from __future__ import annotations

import functools

from torch import Tensor, nn

from pipeline.split_backward import linear

from .conv1d import conv1d_class
from .linear import ColumnParallelLinear

__all__ = ["prepare_split_backward"]


def prepare_split_backward(model: nn.Module) -> None:
    """Route `model`'s linear layers through the I/W split (see the module docstring)."""
    conv1d = conv1d_class()
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            module.defer_weight_grad = False
        elif type(module) is nn.Linear or (conv1d is not None and type(module) is conv1d):
            module.forward = functools.partial(_split_linear_forward, module, type(module) is not nn.Linear)


def _split_linear_forward(module: nn.Module, transposed: bool, x: Tensor) -> Tensor:
    return linear(x, module.weight, module.bias, transposed)
