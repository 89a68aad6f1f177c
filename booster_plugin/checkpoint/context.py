"""CheckpointContext: what the checkpoint code knows of the parallel layout, taken from the plugin in one place.

Every other checkpoint module takes a CheckpointContext and never the plugin: `from_plugin` is the one function
that reads the plugin (its mesh, ranks, sizes, device, timeout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Tuple

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ..plugin import HybridParallelPlugin


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
    def from_plugin(cls, plugin: HybridParallelPlugin) -> CheckpointContext:
        writers = tuple(tuple(plugin.pg_mesh.ravel((0, stage, tp)) for tp in range(plugin.tp_size))
                        for stage in range(plugin.pp_size))
        # the pipeline stage is the pp coordinate (`plugin.stage` is LowLevelZeroPlugin's ZeRO stage, as ColossalAI)
        return cls(device=plugin.device, rank=dist.get_rank(), stage=plugin.ctx.pp.rank, num_stages=plugin.pp_size,
                   tp_rank=plugin.tp_rank, tp_size=plugin.tp_size, dp_rank=plugin.dp_rank, dp_size=plugin.dp_size,
                   timeout_s=plugin.timeout, stage_writers=writers)
