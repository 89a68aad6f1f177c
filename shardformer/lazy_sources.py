"""Where a lazily built model's weights come from: the seam between whoever built the model without its weights
(booster_plugin/lazy: `from_pretrained` or a model built from a config under `LazyInitContext`) and `materialize`,
which allocates what is still on the meta device (after sharding: this rank's shard only).

A model may carry a `WeightSources` (attached with `attach_sources`): for each parameter or buffer name it can fill
(with checkpoint values, or eager init's), `fill` copies this rank's shard of that tensor into a freshly allocated
one. Names it does not hold are initialized by the model's own init, per rank (materialize.py), as missing keys of
`from_pretrained` are.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import Tensor, nn

from .layer.spec import TPSpec
from .layer.tensor_registry import tensor_registry

__all__ = ["WeightSources", "attach_sources", "sources_of", "detach_sources", "tensor_names", "set_lazy_device",
           "lazy_device_of", "set_expert_rows", "expert_rows_of", "copy_tensor_marks"]

# registries keyed by tensor (layer/tensor_registry.py: nothing is written onto torch's tensors):
# a meta tensor -> the device LazyInitContext(default_device=...) materializes it on
_LAZY_DEVICE = tensor_registry()
# stacked expert weights split over expert parallelism -> (first expert, count) of the full tensor's dim 0 they hold
_EXPERT_ROWS = tensor_registry()


def set_lazy_device(t: Tensor, device: torch.device) -> None:
    _LAZY_DEVICE[t] = device


def lazy_device_of(t: Tensor) -> Optional[torch.device]:
    return _LAZY_DEVICE.get(t)


def set_expert_rows(t: Tensor, rows: Tuple[int, int]) -> None:
    _EXPERT_ROWS[t] = rows


def expert_rows_of(t: Tensor) -> Optional[Tuple[int, int]]:
    return _EXPERT_ROWS.get(t)


def copy_tensor_marks(src: Tensor, dst: Tensor) -> None:
    """Give `dst` (allocated for the meta tensor `src`) the expert rows recorded for `src` (its lazy device is spent)."""
    rows = expert_rows_of(src)
    if rows is not None:
        set_expert_rows(dst, rows)


class WeightSources(Protocol):
    """Checkpoint values of a lazily built model, by unsharded parameter / buffer name."""

    def find(self, names: Sequence[str]) -> Optional[str]:
        """The first of `names` (all names of one tensor: tied weights have several) that the sources hold; None when
        the tensor is left to the model's own init, per rank."""

    def fill(self, name: str, dst: Tensor, spec: Optional[TPSpec], rank: int, world: int,
             experts: Optional[Tuple[int, int]] = None) -> None:
        """Copy `rank`'s shard (`spec` over `world` ranks; the whole tensor when `spec` is None) of the tensor of
        `name` into `dst` (the shard's shape, any dtype and device; a checkpoint reads only the shard's bytes).
        `experts`: the (first, count) entries of dim 0 this rank holds besides (expert parallelism)."""


# a lazily built model -> where its weights come from (weak: nothing is set on the model object)
_SOURCES: "weakref.WeakKeyDictionary[nn.Module, WeightSources]" = weakref.WeakKeyDictionary()


def attach_sources(model: nn.Module, sources: WeightSources) -> None:
    _SOURCES[model] = sources


def sources_of(model: nn.Module) -> Optional[WeightSources]:
    return _SOURCES.get(model)


def detach_sources(model: nn.Module) -> None:
    _SOURCES.pop(model, None)


def tensor_names(model: nn.Module) -> Dict[int, List[str]]:
    """{id: every name} of the model's parameters and buffers (a tied weight has several)."""
    names: Dict[int, List[str]] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
    return names
