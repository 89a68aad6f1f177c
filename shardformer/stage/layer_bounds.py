"""Layer indices of pipeline stages from the layers each holds: the one place that turns a split into bounds."""
from __future__ import annotations

import itertools
from typing import List, Sequence

__all__ = ["layer_bounds", "stage_of_layer"]


def layer_bounds(per_stage: Sequence[int]) -> List[int]:
    """[0, end of stage 0, end of stage 1, ...]: (virtual) stage v holds layers [bounds[v], bounds[v + 1])."""
    return [0, *itertools.accumulate(per_stage)]


def stage_of_layer(per_stage: Sequence[int], index: int) -> int:
    """The (virtual) stage holding layer `index`."""
    bounds = layer_bounds(per_stage)
    return next(v for v in range(len(per_stage)) if bounds[v] <= index < bounds[v + 1])
