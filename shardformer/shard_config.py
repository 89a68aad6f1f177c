"""How to shard: the groups, the pipeline stage manager, the sequence split and the options the Sharder applies."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch.distributed as dist

from pipeline.stage_manager import PipelineStageManager

from .layer.dropout import TPRNGTracker

__all__ = ["SequenceSplit", "ShardConfig"]


class SequenceSplit(NamedTuple):
    """Sequence parallelism as the layout resolved it (once, in the parallel context): the mode and the ranks."""
    mode: str                # "split_gather", "all_to_all" or "ring_attn" (sequence/parallel.py)
    group: dist.ProcessGroup  # the ranks the sequence is split over
    size: int
    own_group: bool          # a group of its own (sp_size ranks), not the tp group


@dataclass(frozen=True)
class ShardConfig:
    """How to shard: the tp group (None = no TP), the pipeline stage manager (None = no PP), TP options, the
    sequence split (None = no sequence parallelism; see sequence/parallel.py), the ep group that splits
    mixture-of-experts experts over ranks (expert/sharding.py), and `chunked_loss`: a causal-LM loss in training
    computed chunk by chunk without the full logits (chunked_loss.py), `loss_chunk_size` tokens at a time (None:
    chosen from the shapes). ColossalAI's names for the sequence split (`enable_sequence_parallelism`,
    `sequence_parallelism_mode`, `sequence_parallel_process_group`) are read-only views of `sequence`."""
    tensor_parallel_process_group: Optional[dist.ProcessGroup] = None
    pipeline_stage_manager: Optional[PipelineStageManager] = None
    parallel_output: bool = True
    make_vocab_size_divisible_by: int = 64
    rng_tracker: Optional[TPRNGTracker] = None
    expert_parallel_process_group: Optional[dist.ProcessGroup] = None  # None: experts not split over ranks
    sequence: Optional[SequenceSplit] = None
    chunked_loss: bool = True
    loss_chunk_size: Optional[int] = None

    @property
    def enable_sequence_parallelism(self) -> bool:
        return self.sequence is not None

    @property
    def sp_mode(self) -> Optional[str]:
        """The sequence parallelism mode in effect, None without it."""
        return None if self.sequence is None else self.sequence.mode

    sequence_parallelism_mode = sp_mode

    @property
    def sp_group(self) -> Optional[dist.ProcessGroup]:
        """The group the sequence is split over (None without sequence parallelism)."""
        return None if self.sequence is None else self.sequence.group

    sequence_parallel_process_group = sp_group

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
