"""The parallel context: the job's named mesh axes (dp, pp, tp, sequence parallelism's sp, expert parallelism's ep
and moe_dp; a new kind of parallelism is a new row of AXES), each with its group, size and this rank's coordinate, built once and passed to
whoever needs them.

The mesh has physical dimensions MESH_DIMS; a named axis spans one or more of them: dp, over which the replicas of
the dense parameters reduce their gradients, spans moe_dp × ep (expert parallelism is carved out of data parallel,
as in ColossalAI and Megatron: the ep ranks of a replica group hold different experts, the moe_dp ranks the same
ones). Without expert parallelism (ep = 1) dp and moe_dp are the same ranks, and the rank order is (dp, pp, tp).

Every axis always has a group (size 1 included), so consumers never re-derive sizes or ranks; `Axis.active` is the
group where a collective along the axis does something (size > 1), else None.

`seq` is not a mesh dimension but the answer, decided here once, to "which ranks split a sequence": the sp axis
where sequence parallelism has a group of its own (sp > 1), the tp axis where it runs over tensor parallelism
(`sequence_over_tp`), else the sp axis of size 1 (this rank alone, as ColossalAI's `sp_group` is then).

The carrier is our ProcessGroupMesh, not torch's DeviceMesh: the model also needs groups over subsets of an axis
(the pipeline stages sharing a tied weight), and every rank must create every group in the same order with the
plugin's timeout; DeviceMesh covers whole axes only. The rank order is DeviceMesh's (row-major, the last dimension
innermost), so a DeviceMesh over the same sizes names the same groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, Optional, Sequence, Tuple

import torch.distributed as dist
from torch.distributed import ProcessGroup

from .mesh import ProcessGroupMesh

__all__ = ["AXES", "MESH_DIMS", "Axis", "ParallelContext"]

# the mesh's physical dimensions, outermost first (`dp_outside=False` moves moe_dp inside pp): replicas, pipeline
# stages, expert-parallel ranks, sequence-parallel ranks, tensor parallel innermost (its ranks are contiguous: on one
# host when the world spans several)
MESH_DIMS: Tuple[str, ...] = ("moe_dp", "pp", "ep", "sp", "tp")
# the named axes and the mesh dimensions each spans (outermost first: a rank's coordinate along a spanning axis is
# row-major over them, e.g. dp rank = moe_dp rank * ep size + ep rank)
AXES: Dict[str, Tuple[str, ...]] = {
    "dp": ("moe_dp", "ep"),   # data parallel: every replica of the dense parameters
    "pp": ("pp",),            # pipeline stages
    "tp": ("tp",),            # tensor parallel
    "ep": ("ep",),            # expert parallel: ranks holding different experts of each MoE layer
    "moe_dp": ("moe_dp",),    # data parallel of the expert parameters: ranks holding the same experts
    "sp": ("sp",),            # sequence parallel over a group of its own: ranks holding parts of one sequence
}


@dataclass(frozen=True)
class Axis:
    """One named axis of the mesh, seen from this rank: what a parallel layer is split over.

    `ParallelContext.build` makes the job's axes; `Axis.of_group` makes one from a group the caller holds (the
    ColossalAI mirror's layers); `Axis.alone` is one process alone (a layer that splits nothing)."""
    name: str
    dims: Tuple[int, ...]  # the mesh dimensions it spans (indices into the mesh's shape; () outside a mesh)
    group: Optional[ProcessGroup]  # this rank's group along the axis (a one-rank group when size == 1; None only
                                   # for `Axis.alone`, along which no collective is ever issued)
    size: int
    rank: int              # this rank's coordinate along the axis

    def __deepcopy__(self, memo: dict) -> "Axis":
        return self  # frozen, and its group is a process-wide handle: a copied layer is split over the same axis

    @classmethod
    def of_group(cls, name: str, group: ProcessGroup) -> "Axis":
        """The axis along `group` (its size, this rank's place in it), outside any mesh."""
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"Axis.of_group({name!r}, ...) takes a ProcessGroup, got {type(group).__name__}; for one "
                            f"process alone use Axis.alone({name!r}).")
        return cls(name, (), group, dist.get_world_size(group), dist.get_rank(group))

    @classmethod
    def alone(cls, name: str) -> "Axis":
        """One process alone along `name`: size 1, no group (nothing is split along it, nothing exchanged)."""
        return cls(name, (), None, 1, 0)

    @property
    def index(self) -> int:
        """The mesh dimension of an axis that spans one (pp, tp, ep, moe_dp)."""
        if len(self.dims) != 1:
            raise ValueError(f"axis {self.name!r} spans mesh dimensions {self.dims}, not one.")
        return self.dims[0]

    @property
    def active(self) -> Optional[ProcessGroup]:
        """The group when a collective along this axis does something (size > 1); None otherwise."""
        return self.group if self.size > 1 else None


@dataclass(frozen=True)
class ParallelContext:
    """The named axes of the job's mesh and this rank's place in it (see the module docstring)."""
    mesh: ProcessGroupMesh
    dims: Tuple[str, ...]  # the mesh's dimension names, in its order
    dp: Axis
    pp: Axis
    tp: Axis
    ep: Axis
    moe_dp: Axis
    sp: Axis
    seq: Axis  # the ranks a sequence is split over: sp, tp or one rank (module docstring)

    @classmethod
    def build(cls, sizes: Dict[str, int], timeout: Optional[timedelta] = None,
              dp_outside: bool = True, sequence_over_tp: bool = False) -> "ParallelContext":
        """Collective: the mesh and every axis group.

        Args:
            sizes: {"dp": ..., "pp": ..., "tp": ...} and optionally "ep" (default 1, must divide dp) and "sp"
                (default 1); the product of dp, pp, sp and tp is the world.
            timeout: of every group's collectives.
            dp_outside: the replicas (moe_dp) outermost (default); False puts the pipeline stages outermost
                (ColossalAI's `moe_dp_outside=False`).
            sequence_over_tp: sequence parallelism splits the sequence over the tp group (with sp size 1).
        """
        sizes = dict(sizes)
        ep, sp = sizes.pop("ep", 1), sizes.pop("sp", 1)
        if set(sizes) != {"dp", "pp", "tp"}:
            raise ValueError(f"ParallelContext needs the sizes of dp, pp, tp (and optionally ep, sp), got "
                             f"{sorted(sizes)}.")
        if ep < 1 or sizes["dp"] % ep:
            raise ValueError(f"ep size {ep} must divide the dp size {sizes['dp']}.")
        dim_sizes = {"moe_dp": sizes["dp"] // ep, "pp": sizes["pp"], "ep": ep, "sp": sp, "tp": sizes["tp"]}
        dims = MESH_DIMS if dp_outside else ("pp", "moe_dp", "ep", "sp", "tp")
        mesh = ProcessGroupMesh(*(dim_sizes[d] for d in dims), timeout=timeout)
        axes = {}
        for name, spans in AXES.items():  # every rank creates the groups in this order
            at = tuple(dims.index(d) for d in spans)
            rank, size = 0, 1
            for i in at:
                rank, size = rank * mesh.size(i) + mesh.coordinate[i], size * mesh.size(i)
            axes[name] = Axis(name, at, mesh.get_group_along_axes(at), size, rank)
        seq = axes["tp"] if sequence_over_tp and sp == 1 else axes["sp"]
        return cls(mesh, dims, seq=seq, **axes)

    def group_over(self, axis: Axis, indices: Sequence[int]) -> Optional[ProcessGroup]:
        """Collective: this rank's group of the ranks at `indices` along `axis` (e.g. the stages sharing a tied weight);
        None when this rank is not among them."""
        return self.mesh.get_group_along_axis(axis.index, indices=indices)

    def global_rank(self, **coordinate: int) -> int:
        """The global rank at this rank's coordinate with the given axes changed, e.g. `global_rank(dp=0, tp=0)`."""
        coord = list(self.mesh.coordinate)
        for name, value in coordinate.items():
            axis: Axis = getattr(self, name)
            for i in reversed(axis.dims):  # row-major over the dimensions the axis spans
                coord[i] = value % self.mesh.size(i)
                value //= self.mesh.size(i)
        return self.mesh.ravel(coord)
