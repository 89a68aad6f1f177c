"""The parallel context: the job's named mesh axes (dp, pp, tp; a new kind of parallelism is a new row of AXES),
each with its group, size and this rank's coordinate, built once and passed to whoever needs them.

Every axis always has a group (size 1 included), so consumers never re-derive sizes or ranks; `Axis.active` is the
group where a collective along the axis does something (size > 1), else None.

The carrier is our ProcessGroupMesh, not torch's DeviceMesh: the model also needs groups over subsets of an axis
(the pipeline stages sharing a tied weight), and every rank must create every group in the same order with the
plugin's timeout; DeviceMesh covers whole axes only. The rank order is DeviceMesh's (row-major, the last axis
innermost), so a DeviceMesh over the same sizes names the same groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, Optional, Sequence, Tuple

from torch.distributed import ProcessGroup

from .mesh import ProcessGroupMesh

__all__ = ["AXES", "Axis", "ParallelContext"]

# the mesh's axes, outermost first: data parallel across replicas, pipeline stages inside a replica, tensor parallel
# innermost (its ranks are contiguous: on one host when the world spans several)
AXES: Tuple[str, ...] = ("dp", "pp", "tp")


@dataclass(frozen=True)
class Axis:
    """One named axis of the mesh, seen from this rank."""
    name: str
    index: int             # its position in the mesh (AXES order)
    group: ProcessGroup    # this rank's group along the axis (a one-rank group when size == 1)
    size: int
    rank: int              # this rank's coordinate along the axis

    @property
    def active(self) -> Optional[ProcessGroup]:
        """The group when a collective along this axis does something (size > 1); None otherwise."""
        return self.group if self.size > 1 else None


@dataclass(frozen=True)
class ParallelContext:
    """The named axes of the job's mesh and this rank's place in it (see the module docstring)."""
    mesh: ProcessGroupMesh
    dp: Axis
    pp: Axis
    tp: Axis

    @classmethod
    def build(cls, sizes: Dict[str, int], timeout: Optional[timedelta] = None) -> "ParallelContext":
        """Collective: the mesh of `sizes` (one per name of AXES; their product is the world) and every axis group.

        Args:
            sizes: {"dp": ..., "pp": ..., "tp": ...}.
            timeout: of every group's collectives.
        """
        if set(sizes) != set(AXES):
            raise ValueError(f"ParallelContext needs the sizes of {AXES}, got {sorted(sizes)}.")
        mesh = ProcessGroupMesh(*(sizes[name] for name in AXES), timeout=timeout)
        axes = {name: Axis(name, i, mesh.get_group_along_axis(i), mesh.size(i), mesh.coordinate[i])
                for i, name in enumerate(AXES)}
        return cls(mesh, **axes)

    def group_over(self, axis: Axis, indices: Sequence[int]) -> Optional[ProcessGroup]:
        """Collective: this rank's group of the ranks at `indices` along `axis` (e.g. the stages sharing a tied weight);
        None when this rank is not among them."""
        return self.mesh.get_group_along_axis(axis.index, indices=indices)

    def global_rank(self, **coordinate: int) -> int:
        """The global rank at this rank's coordinate with the given axes changed, e.g. `global_rank(dp=0, tp=0)`."""
        coord = list(self.mesh.coordinate)
        for name, value in coordinate.items():
            coord[AXES.index(name)] = value
        return self.mesh.ravel(coord)
