"""The axis a tensor-parallel layer is split over (pipeline.context.Axis: group, size, this rank's place), the one
way the layout reaches a layer; ColossalAI's names for it (`tp_group`, `tp_size`, `tp_rank`) are read-only views."""
from __future__ import annotations

from typing import Optional

from torch.distributed import ProcessGroup

from pipeline.context import Axis

__all__ = ["Axis", "OnAxis", "checked_axis"]


def checked_axis(tp: object, who: str) -> Axis:
    """`tp` if it is an Axis; a clear error naming the fix otherwise (a group or None passed the old way)."""
    if not isinstance(tp, Axis):
        raise TypeError(f"{who} takes the axis it is split over (pipeline.context.Axis), got {type(tp).__name__}: "
                        f"pass the plugin's `ctx.tp`, `Axis.of_group('tp', group)` for a group you hold, or "
                        f"`Axis.alone('tp')` for one process.")
    return tp


class OnAxis:
    """Mixin of the tensor-parallel layers: `self.tp`, the axis, and its views."""

    tp: Axis

    @property
    def tp_group(self) -> Optional[ProcessGroup]:
        return self.tp.group

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank
