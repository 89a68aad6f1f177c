"""Embedding whose output features are split over the TP group with no communication: a per-head table such as
T5's relative position bias (buckets × heads), where each rank computes the bias of the heads it holds."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .axis import Axis, OnAxis, checked_axis
from .spec import TPSpec, UnshardedStateDict, shard_parameter

__all__ = ["HeadParallelEmbedding"]


class HeadParallelEmbedding(OnAxis, UnshardedStateDict, nn.Module):
    """nn.Embedding with its columns (e.g. attention heads) split in contiguous blocks over the TP group.

    Args:
        module: the native embedding, left untouched; its weight is (num_embeddings, heads).
        tp: the tensor-parallel axis; `heads` must be divisible by its size.
    """

    def __init__(self, module: nn.Embedding, tp: Axis) -> None:
        super().__init__()
        self.tp = checked_axis(tp, type(self).__name__)
        if module.embedding_dim % self.tp_size:
            raise ValueError(f"cannot split {module.embedding_dim} embedding columns (heads) over {self.tp_size} ranks")
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise NotImplementedError("max_norm, scale_grad_by_freq and sparse are not supported")
        self.num_embeddings = module.num_embeddings
        self.embedding_dim = module.embedding_dim // self.tp_size
        self.padding_idx = module.padding_idx
        self.weight = shard_parameter(module.weight, TPSpec(1, group=tp.group), self.tp_rank,
                                      self.tp_size)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} (columns of rank {self.tp_rank}/{self.tp_size})"
