"""A Cartesian mesh of ranks (e.g. dp × pp × tp, last axis innermost) with cached process groups along any axis."""
from __future__ import annotations

import itertools
import math
from datetime import timedelta
from typing import Dict, Optional, Tuple

import torch.distributed as dist
from torch.distributed import ProcessGroup

from .groups import group_backend


class ProcessGroupMesh:
    """Arranges the world's ranks in a row-major grid of `sizes`; the last axis holds contiguous ranks.

    Groups along an axis are created once for the whole world (every rank must take part in `new_group`)
    and cached, so asking again is free. They carry CPU tensors also where the world group has no CPU backend
    (`groups.group_backend`).
    """

    def __init__(self, *sizes: int, timeout: Optional[timedelta] = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ProcessGroupMesh needs torch.distributed to be initialized first.")
        world = dist.get_world_size()
        if math.prod(sizes) != world:
            raise ValueError(f"Mesh sizes {sizes} multiply to {math.prod(sizes)}, but the world size is {world}.")
        self.shape: Tuple[int, ...] = tuple(sizes)
        self.rank = dist.get_rank()
        self.coordinate: Tuple[int, ...] = self.unravel(self.rank)
        self._groups: Dict[Tuple[int, ...], ProcessGroup] = {}
        self.timeout = timeout  # of the groups' collectives; None: the default group's

    def size(self, axis: int) -> int:
        return self.shape[axis]

    def unravel(self, rank: int) -> Tuple[int, ...]:
        """Rank -> coordinate."""
        coord = []
        for size in reversed(self.shape):
            coord.append(rank % size)
            rank //= size
        return tuple(reversed(coord))

    def ravel(self, coord) -> int:
        """Coordinate -> rank."""
        rank = 0
        for c, size in zip(coord, self.shape):
            rank = rank * size + c
        return rank

    def ranks_along_axis(self, axis: int, coord=None) -> Tuple[int, ...]:
        """Ranks that differ from `coord` (default: this rank's) only along `axis`, in axis order."""
        coord = list(self.coordinate if coord is None else coord)
        ranks = []
        for i in range(self.shape[axis]):
            coord[axis] = i
            ranks.append(self.ravel(coord))
        return tuple(ranks)

    def get_group(self, ranks) -> ProcessGroup:
        """The cached group of exactly `ranks`. Collective: every rank must call it with the same `ranks`."""
        ranks = tuple(sorted(ranks))
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks), timeout=self.timeout, backend=group_backend())
        return self._groups[ranks]

    @staticmethod
    def get_ranks_in_group(group: ProcessGroup) -> Tuple[int, ...]:
        """Global ranks of `group`, in group-rank order (ColossalAI's name)."""
        return tuple(dist.get_process_group_ranks(group))

    def get_group_along_axes(self, axes: Tuple[int, ...]) -> ProcessGroup:
        """This rank's group of the ranks that differ from it only along `axes` (e.g. dp spanning two axes).

        Creates that group for every block of the mesh along `axes` (collective on first call)."""
        if len(axes) == 1:
            return self.get_group_along_axis(axes[0])
        others = [range(s) if i not in axes else [0] for i, s in enumerate(self.shape)]
        mine = None
        for coord in itertools.product(*others):
            ranks = []
            for inner in itertools.product(*(range(self.shape[a]) for a in axes)):
                c = list(coord)
                for a, v in zip(axes, inner):
                    c[a] = v
                ranks.append(self.ravel(c))
            group = self.get_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def get_group_along_axis(self, axis: int, indices=None) -> Optional[ProcessGroup]:
        """This rank's group along `axis` (only the ranks at `indices` along it, if given).

        Creates that group for every line of the mesh along `axis` (collective on first call); returns None
        when this rank is not among `indices`.
        """
        others = [range(s) if i != axis else [0] for i, s in enumerate(self.shape)]
        mine = None
        for coord in itertools.product(*others):
            ranks = self.ranks_along_axis(axis, coord)
            if indices is not None:
                ranks = tuple(ranks[i] for i in indices)
            group = self.get_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine
