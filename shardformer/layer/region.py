"""One copy_to_tp of a tp region's input (e.g. an attention block's hidden states) shared by the modules inside it
whose input gradient covers only this rank's split (column layers, key/value projections keeping this rank's
head): their summed input gradient is all-reduced once, not once each. Other uses of the input inside the region
(e.g. a padding mask applied before the projections) keep their full gradients: the copy is made lazily, when the
first such module reads exactly the region's input."""
from __future__ import annotations

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .comm import copy_to_tp
from .linear import ColumnParallelLinear

__all__ = ["RegionInput", "share_region_input"]


class RegionInput:
    """A region's input (`source`) and its one copy to the tp region, made on first use."""

    def __init__(self, source: Tensor, group: ProcessGroup | None) -> None:
        self.source, self.group, self._copied = source, group, None

    def copied(self) -> Tensor:
        if self._copied is None:
            self._copied = copy_to_tp(self.source, self.group)
        return self._copied


def share_region_input(region: nn.Module, group: ProcessGroup | None) -> None:
    """Hook `region` so that the split-input modules inside it (those carrying `region_input`: column layers, and
    kept-whole key/value projections) share one copy of its input while it runs."""
    members = [m for m in region.modules() if isinstance(m, ColumnParallelLinear) or hasattr(m, "region_input")]
    if members:
        region.register_forward_pre_hook(_RegionEntry(members, group), with_kwargs=True)
        region.register_forward_hook(_RegionExit(members))


class _RegionEntry:
    """Forward pre-hook: tell the region's members its input."""

    def __init__(self, members, group) -> None:
        self.members, self.group = members, group

    def __call__(self, module, args, kwargs):
        if args:
            source = args[0]
        else:
            source = kwargs["hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))]
        shared = RegionInput(source, self.group)
        for member in self.members:
            member.region_input = shared
        return None


class _RegionExit:
    """Forward hook: forget the region's input (no reference kept past the region's forward)."""

    def __init__(self, members) -> None:
        self.members = members

    def __call__(self, module, args, output):
        for member in self.members:
            member.region_input = None
