"""Registries of what we know about torch's tensors (their tensor-parallel split, the groups their gradient is summed
over, lazy-init marks), keyed by identity (a tensor's == is elementwise) and weakly (a dropped tensor leaves no
entry): nothing is written onto the tensors. Every registry is made here, so the one operation that needs a tensor
without weak references, `torch.utils.swap_tensors`, can set its entries aside around the swap (`unregistered`)."""
from __future__ import annotations

import contextlib
from typing import Iterator, List

from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["tensor_registry", "unregistered"]

_REGISTRIES: List[WeakIdKeyDictionary] = []


def tensor_registry() -> WeakIdKeyDictionary:
    """A new registry keyed by tensor identity."""
    registry = WeakIdKeyDictionary()
    _REGISTRIES.append(registry)
    return registry


@contextlib.contextmanager
def unregistered(*tensors: Tensor) -> Iterator[None]:
    """Inside, `tensors` are in no registry (`torch.utils.swap_tensors` refuses a tensor with weak references); on
    exit each entry is put back on the same tensor object, whatever its contents are now."""
    held = [(registry, t, registry.pop(t)) for registry in _REGISTRIES for t in tensors if t in registry]
    try:
        yield
    finally:
        for registry, t, value in held:
            registry[t] = value
