"""Every fact about a pipeline schedule style (`pp_style`), in one registry.

A style names a generator (pipeline/schedules.py) and what its order implies for the rest of the system: where the
virtual stages live (pipeline/layout.py), how many model chunks a rank holds, how many microbatches a step needs,
whether its backward is split into I and W (the model's linear layers then defer their weight gradients:
pipeline/split_backward.py), whether it re-plans its order for measured costs (pipeline/refine.py), and which
transports and pipeline sizes it runs on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from .actions import Schedule
from .layout import LOOP, V, StageLayout
from .schedules import dual_pipe_v, interleaved, one_f_one_b, zero_bubble_v

__all__ = ["STYLES", "ScheduleStyle", "make_schedule", "style_named"]


@dataclass(frozen=True)
class ScheduleStyle:
    """One `pp_style` and everything it implies."""
    name: str
    generate: Callable[[int, int, int], Schedule]  # (ranks p, chunks per rank v, microbatches m) -> schedule
    layout_style: str                # LOOP or V
    min_chunks: int                  # model chunks per rank
    max_chunks: Optional[int]        # None: no upper bound
    microbatches_per_rank: int = 1   # a step needs at least this many microbatches per pipeline rank
    microbatches_multiple_of_ranks: bool = False
    splits_backward: bool = False    # I and W actions: the model defers its linear layers' weight gradients
    replans_for_measured_costs: bool = False  # pp_schedule_costs="measured" re-plans its order
    min_ranks: int = 1               # the fewest pipeline ranks it runs on
    runs_on_broadcast: bool = False  # its order also runs on the "broadcast" transport (whose sends wait)

    def layout(self, num_ranks: int, num_chunks: int) -> StageLayout:
        """Where the virtual stages live (raises ValueError for a number of chunks the style cannot hold)."""
        if num_chunks < self.min_chunks or (self.max_chunks is not None and num_chunks > self.max_chunks):
            need = f"num_model_chunks={self.min_chunks}" if self.min_chunks == self.max_chunks \
                else f"num_model_chunks >= {self.min_chunks}"
            raise ValueError(f"pp_style={self.name!r} needs {need}, got num_model_chunks={num_chunks}.")
        return StageLayout(num_ranks, num_chunks, self.layout_style)

    def min_microbatches(self, num_ranks: int) -> int:
        """The fewest microbatches a step can have on `num_ranks` pipeline ranks."""
        return self.microbatches_per_rank * num_ranks

    def make(self, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
        """The schedule for p ranks, v chunks per rank and m microbatches (raises ValueError if invalid)."""
        self.layout(num_ranks, num_chunks)
        return self.generate(num_ranks, num_chunks, num_microbatches)


STYLES: Dict[str, ScheduleStyle] = {style.name: style for style in (
    ScheduleStyle("1f1b", lambda p, v, m: one_f_one_b(p, m), LOOP, 1, 1, runs_on_broadcast=True),
    ScheduleStyle("interleaved", interleaved, LOOP, 2, None, microbatches_multiple_of_ranks=True, min_ranks=2),
    ScheduleStyle("zbv", lambda p, v, m: zero_bubble_v(p, m), V, 2, 2, splits_backward=True,
                  replans_for_measured_costs=True, min_ranks=2),
    ScheduleStyle("dualpipev", lambda p, v, m: dual_pipe_v(p, m), V, 2, 2, microbatches_per_rank=2,
                  splits_backward=True, replans_for_measured_costs=True, min_ranks=2),
)}


def style_named(name: str) -> ScheduleStyle:
    """The style called `name` (raises ValueError naming the styles there are)."""
    if name not in STYLES:
        raise ValueError(f"Unknown pp_style {name!r}; use one of {tuple(STYLES)}.")
    return STYLES[name]


def make_schedule(style: str, num_ranks: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """The schedule of the style called `style` for p ranks, v chunks per rank and m microbatches (raises
    ValueError if invalid)."""
    return style_named(style).make(num_ranks, num_chunks, num_microbatches)
