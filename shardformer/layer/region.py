"""A tp region's input (e.g. an attention block's hidden states) as the split-input modules inside it read it:
column layers, and key/value projections kept whole that keep this rank's head. They share one entry into the tp
region, so their summed input gradient is all-reduced once, not once each.

- Without sequence parallelism the entry is one copy_to_tp, made lazily when the first such module reads exactly
  the region's input; other uses of the input inside the region (e.g. a padding mask applied before the
  projections) keep their full gradients.
- With split_gather sequence parallelism (training) the region's input is the sequence gathered from this rank's
  shard (its backward reduce-scatters); column layers keep only the shard for their backward (`shard`).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from torch import Tensor
from torch.distributed import ProcessGroup

from .comm import copy_to_tp, gather_from_sequence

__all__ = ["RegionInput", "ShardSource", "enter_region"]


class ShardSource(NamedTuple):
    """The sequence shard a gathered region input came from, and its bookkeeping (linear.SequenceShard)."""
    shard: Tensor
    source: object


class RegionInput:
    """A region's input (`source`) and its one entry into the tp region."""

    def __init__(self, source: Tensor, group: Optional[ProcessGroup], shard: Optional[ShardSource] = None) -> None:
        self.source, self.group, self.shard, self._copied = source, group, shard, None

    def copied(self) -> Tensor:
        """The input as split-input modules read it (its gradient is summed over the group)."""
        if self.shard is not None:  # gathered from the sequence shards: the gather's backward sums already
            return self.source
        if self._copied is None:
            self._copied = copy_to_tp(self.source, self.group)
        return self._copied

    def holds(self, x: Tensor) -> bool:
        """Is `x` this region's input, as given or as entered?"""
        return x is self.source or (self._copied is not None and x is self._copied)


def enter_region(x: Tensor, group: Optional[ProcessGroup], sequence_dim: Optional[int]) -> RegionInput:
    """The region input for `x`: with `sequence_dim` (split_gather, training) `x` is a sequence shard, gathered now."""
    if sequence_dim is None:
        return RegionInput(x, group)
    from .linear import SequenceShard
    return RegionInput(gather_from_sequence(x, sequence_dim, group), group,
                       ShardSource(x, SequenceShard(sequence_dim, group)))
