"""Tensor-parallel regions: the module (e.g. an attention or an MLP) whose column-parallel layers all read its input
enters the tp region once, at its input, instead of once per column layer: one copy_to_tp (one all-reduce of the
summed input gradient in backward) or, with split_gather sequence parallelism in training mode, one all-gather of
the sequence shard (one reduce-scatter in backward). A column layer whose input is not exactly the region's entered
input enters by itself."""
from __future__ import annotations

from typing import List, Optional, Tuple

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .layer import ColumnParallelLinear, SequenceShard, copy_to_tp, gather_from_sequence
from .policies.base import Policy, match

__all__ = ["enter_tp_regions_once"]


def enter_tp_regions_once(model: nn.Module, policy: Policy, group: ProcessGroup, sequence_dim: Optional[int]) -> None:
    """Hook the policy's `tp_input_regions` (base-relative patterns) that hold column layers.

    Args:
        model: the sharded model.
        policy: its policy.
        group: the tp group.
        sequence_dim: the sequence dimension with split_gather sequence parallelism, else None.
    """
    prefix = policy.base_prefix
    for path, region in model.named_modules():
        rel = path[len(prefix):] if path.startswith(prefix) else None
        if rel is None or not any(match(p, rel) for p in policy.tp_input_regions):
            continue
        columns = [m for m in region.modules() if isinstance(m, ColumnParallelLinear)]
        if columns:
            region.register_forward_pre_hook(_RegionEntry(columns, group, sequence_dim), with_kwargs=True)
            region.register_forward_hook(_RegionExit(columns))


def enter_region(x: Tensor, group: ProcessGroup, sequence_dim: Optional[int]) -> Tuple[Tensor, Optional[tuple]]:
    """A tp region's input as its column layers read it, and the shard it came from: with `sequence_dim`
    (split_gather, training) the sequence gathered from its shards, else `x` copied into the region."""
    if sequence_dim is None:
        return copy_to_tp(x, group), None
    return gather_from_sequence(x, sequence_dim, group), (x, SequenceShard(sequence_dim, group))


class _RegionEntry:
    """Forward pre-hook: enter the tp region with the module's input once and tell its column layers (with
    `sequence_dim`, in training mode: the gathered sequence, and the shard it came from)."""

    def __init__(self, columns: List[ColumnParallelLinear], group: ProcessGroup, sequence_dim: Optional[int]) -> None:
        self.columns, self.group, self.sequence_dim = columns, group, sequence_dim

    def __call__(self, module, args, kwargs):
        key = None if args else ("hidden_states" if "hidden_states" in kwargs else next(iter(kwargs)))
        x = args[0] if args else kwargs[key]
        entered, shard = enter_region(x, self.group, self.sequence_dim if module.training else None)
        for column in self.columns:
            column.copied_input, column.copied_shard = entered, shard
        if args:
            return (entered, *args[1:]), kwargs
        return args, {**kwargs, key: entered}


class _RegionExit:
    """Forward hook: forget the region's entered input (no reference kept past the region's forward)."""

    def __init__(self, columns: List[ColumnParallelLinear]) -> None:
        self.columns = columns

    def __call__(self, module, args, output):
        for column in self.columns:
            column.copied_input = column.copied_shard = None
