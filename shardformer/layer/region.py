"""A tp region's input (e.g. an attention block's hidden states) as the split-input modules inside it read it:
column layers, and key/value projections kept whole that keep this rank's head. They share one entry into the tp
region, so their summed input gradient is all-reduced once, not once each.

- Without sequence parallelism the entry is one copy_to_tp, made lazily when the first such module reads exactly
  the region's input; other uses of the input inside the region (e.g. a padding mask applied before the
  projections) keep their full gradients.
- With split_gather sequence parallelism (training) the region's input is the sequence gathered from this rank's
  shard (its backward reduce-scatters); column layers keep only the shard for their backward (`shard`).

Without sequence parallelism the region's column layers (`members`) defer their weight gradients to the entry's
backward, which computes them while the input gradient is being summed (layer/deferred.py).

Which modules read a region's input, and the input while the region runs, are held here, in a registry keyed by
module (`join_region`, `region_input_of`, `set_region_input`): nothing is written onto the modules, some of which
(key/value projections kept whole) are transformers'.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence
from weakref import WeakKeyDictionary

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .comm import copy_to_tp, gather_from_sequence, get_tp_world_size
from .deferred import Deferring, enter_deferring
from .sequence_shard import SequenceShard, split_dim

__all__ = ["RegionInput", "RegionSlot", "ShardSource", "enter_region", "join_region", "is_region_member",
           "region_input_of", "set_region_input"]


class ShardSource(NamedTuple):
    """The sequence shard a gathered region input came from, and its bookkeeping."""
    shard: Tensor
    source: SequenceShard


class RegionInput:
    """A region's input (`source`) and its one entry into the tp region; `members`: the modules that read it
    (column layers among them may defer their weight gradients to the entry)."""

    def __init__(self, source: Tensor, group: Optional[ProcessGroup], shard: Optional[ShardSource] = None,
                 members: Sequence[nn.Module] = ()) -> None:
        self.source, self.group, self.shard, self.members = source, group, shard, members
        self._copied: Optional[Tensor] = None
        self.deferred: Optional[Deferring] = None

    def copied(self) -> Tensor:
        """The input as split-input modules read it (its gradient is summed over the group)."""
        if self.shard is not None:  # gathered from the sequence shards: the gather's backward sums already
            return self.source
        if self._copied is None:
            if get_tp_world_size(self.group) > 1:
                self._copied, self.deferred = enter_deferring(self.source, self.group, self.members)
            if self.deferred is None:
                self._copied = copy_to_tp(self.source, self.group)
        return self._copied

    def defers(self, layer: nn.Module) -> bool:
        """Does `layer` hand its weight gradient to this entry (call after `copied()`)?"""
        return self.deferred is not None and any(layer is m for m in self.deferred.layers)

    def holds(self, x: Tensor) -> bool:
        """Is `x` this region's input, as given or as entered?"""
        return x is self.source or (self._copied is not None and x is self._copied)


def enter_region(x: Tensor, group: Optional[ProcessGroup], sequence_dim: Optional[int],
                 members: Sequence[nn.Module] = ()) -> RegionInput:
    """The region input for `x`: with `sequence_dim` (split_gather, training) `x` is a sequence shard, gathered now.
    `members`: the modules reading it."""
    if sequence_dim is None:
        return RegionInput(x, group, members=members)
    dim = split_dim(x, sequence_dim)
    return RegionInput(gather_from_sequence(x, dim, group), group, ShardSource(x, SequenceShard(dim, group)))


class RegionSlot:
    """Where a region member finds the input of the region it runs in (None outside one). Its holders keep it (the
    region's hooks, the member's own hooks, our column layers as `region_slot`) and read or set `region` in forward,
    without looking anything up: a compiled layer traces no registry."""
    __slots__ = ("region",)

    def __init__(self) -> None:
        self.region: Optional[RegionInput] = None


# module -> its slot, for modules we do not own (our layers hold theirs as `region_slot`)
_SLOTS: "WeakKeyDictionary[nn.Module, RegionSlot]" = WeakKeyDictionary()


def join_region(module: nn.Module) -> RegionSlot:
    """Make `module` a region member (at sharding): its slot, which the enclosing region's hooks fill."""
    own = getattr(module, "region_slot", None)
    if isinstance(own, RegionSlot):
        return own
    slot = _SLOTS.get(module)
    if slot is None:
        slot = _SLOTS[module] = RegionSlot()
    return slot


def is_region_member(module: nn.Module) -> bool:
    """Did `module` join a region (`join_region`)?"""
    return isinstance(getattr(module, "region_slot", None), RegionSlot) or module in _SLOTS


def region_input_of(module: nn.Module) -> Optional[RegionInput]:
    """The input of the region `module` runs in now, or None."""
    return join_region(module).region if is_region_member(module) else None


def set_region_input(module: nn.Module, region: Optional[RegionInput]) -> None:
    """Tell `module` the input of the region it runs in (None: it runs in none)."""
    join_region(module).region = region
