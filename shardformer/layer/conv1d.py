"""transformers' Conv1D (a linear layer that stores its weight (in, out)), recognised without requiring transformers:
the one place that imports it."""
from __future__ import annotations

from typing import Optional, Type

from torch import nn

__all__ = ["conv1d_class", "is_conv1d"]


def conv1d_class() -> Optional[Type[nn.Module]]:
    """transformers' Conv1D class; None where transformers is not installed."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is optional
        return None
    return Conv1D


def is_conv1d(module: nn.Module) -> bool:
    """Is `module` a transformers Conv1D (or a subclass)?"""
    cls = conv1d_class()
    return cls is not None and isinstance(module, cls)
