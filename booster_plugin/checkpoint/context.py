"""CheckpointContext: what the checkpoint code knows of the parallel layout, taken from the plugin in one place.

Every other checkpoint module takes a CheckpointContext and never the plugin: `from_plugin` is the one function
that reads the plugin (its mesh, ranks, sizes, device, timeout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Tuple

import torch
import torch.distributed as dist

from pipeline.context import ParallelContext


class PluginLayout(Protocol):
    """What `from_plugin` reads of a plugin (HybridParallelPlugin and its subclasses)."""
    ctx: ParallelContext
    device: torch.device
    timeout: float


@dataclass(frozen=True)
class CheckpointContext:
    """This rank's place in the (dp, pp, tp) layout, as checkpoints need it."""

    device: torch.device                        # of the tensors that collectives (agreements, gathers) send
    rank: int                                   # this process's global rank
    stage: int                                  # this rank's pipeline stage
    num_stages: int                             # pp size
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    timeout_s: float                            # how long rank 0 waits for a save's other writers
    stage_writers: Tuple[Tuple[int, ...], ...]  # [stage][tp rank] -> global rank of dp rank 0 there
    ep_rank: int = 0                            # expert parallel: dp = moe_dp x ep; expert parameters (split over
    ep_size: int = 1                            # ep) are gathered over the ep ranks of moe_dp rank 0
    moe_dp_rank: int = 0
    ep_group: Optional[dist.ProcessGroup] = None  # None without expert parallelism
    sp_rank: int = 0                            # sequence-parallel ranks hold the same parameters: sp rank 0 saves

    def gathers(self, expert: bool) -> bool:
        """Whether this rank takes part in gathering a parameter of its stage: dp rank 0 (every tp rank); for an
        expert parameter, every ep rank of moe_dp rank 0; sp rank 0 only."""
        return self.sp_rank == 0 and (self.moe_dp_rank == 0 if expert else self.dp_rank == 0)

    @property
    def writes(self) -> bool:
        """Whether this rank writes its (stage, tp rank)'s files: dp rank 0 and sp rank 0."""
        return self.dp_rank == 0 and self.sp_rank == 0

    def writer_rank(self, stage: int, tp_rank: int = 0) -> int:
        """The global rank that writes a (stage, tp rank)'s tensors: dp rank 0 of it."""
        return self.stage_writers[stage][tp_rank]

    @classmethod
    def from_plugin(cls, plugin: PluginLayout) -> CheckpointContext:
        ctx = plugin.ctx
        writers = tuple(tuple(ctx.global_rank(dp=0, sp=0, pp=stage, tp=tp) for tp in range(ctx.tp.size))
                        for stage in range(ctx.pp.size))
        return cls(device=plugin.device, rank=dist.get_rank(), stage=ctx.pp.rank, num_stages=ctx.pp.size,
                   tp_rank=ctx.tp.rank, tp_size=ctx.tp.size, dp_rank=ctx.dp.rank, dp_size=ctx.dp.size,
                   timeout_s=plugin.timeout, stage_writers=writers, ep_rank=ctx.ep.rank, ep_size=ctx.ep.size,
                   moe_dp_rank=ctx.moe_dp.rank, ep_group=ctx.ep.active, sp_rank=ctx.sp.rank)
