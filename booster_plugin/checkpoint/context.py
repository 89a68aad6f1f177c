"""CheckpointContext: what the checkpoint code knows of the parallel layout, taken from the plugin in one place.

Every other checkpoint module takes a CheckpointContext and never the plugin: `from_plugin` is the one function
that reads the plugin (its mesh, ranks, sizes, device, timeout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Tuple

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

    def writer_rank(self, stage: int, tp_rank: int = 0) -> int:
        """The global rank that writes a (stage, tp rank)'s tensors: dp rank 0 of it."""
        return self.stage_writers[stage][tp_rank]

    @classmethod
    def from_plugin(cls, plugin: PluginLayout) -> CheckpointContext:
        ctx = plugin.ctx
        writers = tuple(tuple(ctx.global_rank(dp=0, pp=stage, tp=tp) for tp in range(ctx.tp.size))
                        for stage in range(ctx.pp.size))
        return cls(device=plugin.device, rank=dist.get_rank(), stage=ctx.pp.rank, num_stages=ctx.pp.size,
                   tp_rank=ctx.tp.rank, tp_size=ctx.tp.size, dp_rank=ctx.dp.rank, dp_size=ctx.dp.size,
                   timeout_s=plugin.timeout, stage_writers=writers)
