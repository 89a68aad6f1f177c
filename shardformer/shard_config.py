"""How to shard: the groups, the pipeline stage manager and the tensor-parallel options the Sharder applies."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from pipeline.stage_manager import PipelineStageManager

from .layer.dropout import TPRNGTracker

__all__ = ["ShardConfig"]


@dataclass(frozen=True)
class ShardConfig:
    """How to shard: the tp group (None = no TP), the pipeline stage manager (None = no PP) and TP options;
    `enable_sequence_parallelism` splits the sequence over the tp group (`sequence_parallelism_mode`
    "split_gather", the default, or "all_to_all"; see sequence_parallel.py); the ep group splits mixture-of-experts
    experts over ranks (expert_sharding.py)."""
    tensor_parallel_process_group: Optional[dist.ProcessGroup] = None
    pipeline_stage_manager: Optional[PipelineStageManager] = None
    parallel_output: bool = True
    make_vocab_size_divisible_by: int = 64
    rng_tracker: Optional[TPRNGTracker] = None
    enable_sequence_parallelism: bool = False
    sequence_parallelism_mode: Optional[str] = None
    expert_parallel_process_group: Optional[dist.ProcessGroup] = None  # None: experts not split over ranks
    # sequence parallelism over a group of its own ("all_to_all", "ring_attn" with sp_size > 1); None: over tp
    sequence_parallel_process_group: Optional[dist.ProcessGroup] = None

    @property
    def sp_group(self) -> Optional[dist.ProcessGroup]:
        """The group the sequence is split over (None without sequence parallelism)."""
        if self.sp_mode is None:
            return None
        return self.sequence_parallel_process_group or self.tensor_parallel_process_group

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks the sequence is split over (ColossalAI's name; 1 without sequence parallelism)."""
        group = self.sp_group
        return 1 if group is None else dist.get_world_size(group)

    @property
    def ep_size(self) -> int:
        group = self.expert_parallel_process_group
        return 1 if group is None else dist.get_world_size(group)

    @property
    def tp_size(self) -> int:
        group = self.tensor_parallel_process_group
        return 1 if group is None else dist.get_world_size(group)

    @property
    def sp_mode(self) -> Optional[str]:
        """The sequence parallelism mode in effect, None without it."""
        if not self.enable_sequence_parallelism:
            return None
        return self.sequence_parallelism_mode or "split_gather"
