"""Embedding whose output features are split over the TP group with no communication: a per-head table such as
T5's relative position bias (buckets × heads), where each rank computes the bias of the heads it holds."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .comm import get_tp_rank, get_tp_world_size
from .spec import TPSpec, UnshardedStateDict, shard_parameter

__all__ = ["HeadParallelEmbedding"]


class HeadParallelEmbedding(UnshardedStateDict, nn.Module):
    """nn.Embedding with its columns (e.g. attention heads) split in contiguous blocks over the TP group.

    Args:
        module: the native embedding, left untouched; its weight is (num_embeddings, heads).
        tp_group: the tensor-parallel group; `heads` must be divisible by its size.
    """

    def __init__(self, module: nn.Embedding, tp_group: ProcessGroup | None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = get_tp_world_size(tp_group), get_tp_rank(tp_group)
        if module.embedding_dim % self.tp_size:
            raise ValueError(f"cannot split {module.embedding_dim} embedding columns (heads) over {self.tp_size} ranks")
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise NotImplementedError("max_norm, scale_grad_by_freq and sparse are not supported")
        self.num_embeddings = module.num_embeddings
        self.embedding_dim = module.embedding_dim // self.tp_size
        self.padding_idx = module.padding_idx
        self.weight = shard_parameter(module.weight, TPSpec(1, group=tp_group), self.tp_rank,
                                      self.tp_size)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} (columns of rank {self.tp_rank}/{self.tp_size})"
