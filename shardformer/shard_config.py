"""How to shard: the axes the model is split over (tp, ep; the sequence split), the pipeline stage manager and the
options the Sharder applies. The layout itself is the ParallelContext's (pipeline/context.py): this holds its axes,
and ColossalAI's names for the groups (`tensor_parallel_process_group`, ...) are read-only views of them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch.distributed as dist

from pipeline.context import Axis
from pipeline.stage_manager import PipelineStageManager

from .layer.dropout import TPRNGTracker

__all__ = ["SequenceSplit", "ShardConfig"]


class SequenceSplit(NamedTuple):
    """Sequence parallelism as the layout resolved it (once, in the parallel context: `ctx.seq`): the mode and the
    axis the sequence is split over."""
    mode: str                # "split_gather", "all_to_all" or "ring_attn" (sequence/parallel.py)
    axis: Axis               # the ranks the sequence is split over (ctx.seq)
    own_group: bool          # a group of its own (sp_size ranks), not the tp group

    @property
    def group(self) -> dist.ProcessGroup:
        return self.axis.group

    @property
    def size(self) -> int:
        return self.axis.size


@dataclass(frozen=True)
class ShardConfig:
    """How to shard: the tp axis (size 1: no TP), the pipeline stage manager (None = no PP), TP options, the
    sequence split (None = no sequence parallelism; see sequence/parallel.py), the ep axis that splits
    mixture-of-experts experts over ranks (size 1: not split; expert/sharding.py), and `chunked_loss`: a causal-LM
    loss in training computed chunk by chunk without the full logits (chunked_loss.py), `loss_chunk_size` tokens at
    a time (None: chosen from the shapes), its per-chunk arithmetic compiled with torch.compile where
    `compile_loss` (the plugin's compile_layers). ColossalAI's names (`tensor_parallel_process_group`,
    `expert_parallel_process_group`, `enable_sequence_parallelism`, `sequence_parallelism_mode`,
    `sequence_parallel_process_group`) are read-only views of the axes and of `sequence`."""
    tp: Axis = field(default_factory=lambda: Axis.alone("tp"))
    pipeline_stage_manager: Optional[PipelineStageManager] = None
    parallel_output: bool = True
    make_vocab_size_divisible_by: int = 64
    rng_tracker: Optional[TPRNGTracker] = None
    ep: Axis = field(default_factory=lambda: Axis.alone("ep"))
    sequence: Optional[SequenceSplit] = None
    chunked_loss: bool = True
    loss_chunk_size: Optional[int] = None
    compile_loss: bool = False

    @property
    def tensor_parallel_process_group(self) -> Optional[dist.ProcessGroup]:
        """The tp group where tp splits anything (ColossalAI's name), else None."""
        return self.tp.active

    @property
    def expert_parallel_process_group(self) -> Optional[dist.ProcessGroup]:
        """The ep group where experts are split over ranks, else None."""
        return self.ep.active

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
        return 1 if self.sequence is None else self.sequence.size

    @property
    def ep_size(self) -> int:
        return self.ep.size

    @property
    def tp_size(self) -> int:
        return self.tp.size
