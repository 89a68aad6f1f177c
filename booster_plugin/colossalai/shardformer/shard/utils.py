"""`colossalai.shardformer.shard.utils.set_tensors_to_none`: drop a module's parameters and buffers (recursively
from `exclude`'s complement), as ColossalAI does to free a pipeline stage's unused layers."""
from typing import Set

from torch import nn

__all__ = ["set_tensors_to_none"]


def set_tensors_to_none(model: nn.Module, exclude: Set[nn.Module] = frozenset()) -> None:
    if model in exclude:
        return
    for name in list(model._parameters):
        model._parameters[name] = None
    for name in list(model._buffers):
        model._buffers[name] = None
    for child in model.children():
        set_tensors_to_none(child, exclude)
