"""Tensor-parallel regions: the module (e.g. an attention or an MLP) whose split-input modules (column-parallel
layers, key/value projections kept whole) all read its input enters the tp region once for all of them (see
layer/region.py): one copy_to_tp (one all-reduce of the summed input gradient in backward) or, with split_gather
sequence parallelism in training mode, one all-gather of the sequence shard (one reduce-scatter in backward). A
module whose input is not exactly the region's input enters by itself."""
from __future__ import annotations

from typing import List, Optional, TYPE_CHECKING

from torch import nn
from torch.distributed import ProcessGroup

from pipeline.context import Axis

from ..layer.linear import ColumnParallelLinear
from ..layer.region import enter_region, is_region_member, join_region
from ..paths import match

if TYPE_CHECKING:  # the plan's type only: plans import this room's vocabulary, not the reverse
    from ..policies.plan import Plan

__all__ = ["enter_tp_regions_once"]


def enter_tp_regions_once(model: nn.Module, plan: Plan, tp: Axis, sequence_dim: Optional[int]) -> None:
    """Hook the plan's `tp_input_regions` (base-relative patterns) that hold split-input modules.

    Args:
        model: the sharded model.
        plan: its plan.
        tp: the tp axis.
        sequence_dim: the sequence dimension with split_gather sequence parallelism, else None.
    """
    prefix = plan.base_prefix
    for path, region in model.named_modules():
        rel = path[len(prefix):] if path.startswith(prefix) else None
        if rel is None or not any(match(p, rel) for p in plan.tp_input_regions):
            continue
        members = [m for m in region.modules() if isinstance(m, ColumnParallelLinear) or is_region_member(m)]
        if members:
            region.register_forward_pre_hook(_RegionEntry(members, tp.group, sequence_dim), with_kwargs=True)
            region.register_forward_hook(_RegionExit(members))


class _RegionEntry:
    """Forward pre-hook: tell the region's members its input. With `sequence_dim` in training mode the module's
    input is replaced by the gathered sequence (everything inside the region sees the whole sequence)."""

    def __init__(self, members: List[nn.Module], group: ProcessGroup, sequence_dim: Optional[int]) -> None:
        self.members, self.group, self.sequence_dim = members, group, sequence_dim
        self.slots = [join_region(m) for m in members]  # set in forward: nothing looked up then

    def __call__(self, module, args, kwargs):
        key = None if args else ("hidden_states" if "hidden_states" in kwargs else next(iter(kwargs)))
        x = args[0] if args else kwargs[key]
        region = enter_region(x, self.group, self.sequence_dim if module.training else None, self.members)
        for slot in self.slots:
            slot.region = region
        if region.shard is None:
            return None
        if args:
            return (region.source, *args[1:]), kwargs
        return args, {**kwargs, key: region.source}


class _RegionExit:
    """Forward hook: forget the region's input (no reference kept past the region's forward)."""

    def __init__(self, members: List[nn.Module]) -> None:
        self.slots = [join_region(m) for m in members]

    def __call__(self, module, args, output):
        for slot in self.slots:
            slot.region = None
