"""Vocab-parallel embedding (rows split over the TP group) and the matching vocab-parallel LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .axis import Axis, OnAxis, checked_axis
from .linear import ColumnParallelLinear
from .vocab_split import combine_lookup, local_ids
from .spec import UnshardedStateDict, TPSpec, get_tp_spec, padded_size, set_tp_spec, shard_parameter, zero_padding

__all__ = ["VocabParallelEmbedding", "vocab_parallel_lm_head"]


class VocabParallelEmbedding(OnAxis, UnshardedStateDict, nn.Module):
    """Embedding whose vocabulary rows are split in contiguous blocks over the TP group.

    The vocab is padded with zero rows to a multiple of `make_vocab_size_divisible_by * tp_size`; each rank looks up
    the ids it owns, zeroes the rest, and the partial results are summed over the group.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: Axis,
        *,
        padding_idx: int | None = None,
        make_vocab_size_divisible_by: int = 64,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = checked_axis(tp, type(self).__name__)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.padded_num_embeddings = padded_size(num_embeddings, self.tp_size, make_vocab_size_divisible_by)
        per_rank = self.padded_num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=device, dtype=dtype))
        set_tp_spec(self.weight, TPSpec(0, full_size=num_embeddings, padded=self.padded_num_embeddings,
                                        group=tp.group))
        if self.weight.device.type != "meta":  # meta: parameters are replaced right after
            self.reset_parameters()

    @property
    def local_padding_idx(self) -> int | None:
        """padding_idx as a local row index, or None when another rank holds it."""
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            return self.padding_idx - self.vocab_start
        return None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 1) init like nn.Embedding; padding rows and the padding_idx row are zero."""
        self.weight.normal_()
        zero_padding(self.weight, get_tp_spec(self.weight), self.tp_rank, self.tp_size)
        if self.local_padding_idx is not None:
            self.weight[self.local_padding_idx].zero_()

    @classmethod
    def from_native_module(
        cls, module: nn.Embedding, tp: Axis, make_vocab_size_divisible_by: int = 64
    ) -> "VocabParallelEmbedding":
        """Shard an nn.Embedding; the native module is left untouched."""
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise NotImplementedError("max_norm, scale_grad_by_freq and sparse are not supported")
        layer = cls(module.num_embeddings, module.embedding_dim, tp, padding_idx=module.padding_idx,
                    make_vocab_size_divisible_by=make_vocab_size_divisible_by, device="meta",
                    dtype=module.weight.dtype)
        layer.weight = shard_parameter(module.weight, get_tp_spec(layer.weight), layer.tp_rank, layer.tp_size)
        return layer

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        # the lookup below masks ids other ranks own, so an id outside the vocabulary would silently embed as zeros;
        # every tp rank holds the same ids and raises the same error (as nn.Embedding would) before the all-reduce
        if bool(((ids < 0) | (ids >= self.num_embeddings)).any()):
            bad = ids[(ids < 0) | (ids >= self.num_embeddings)][0]
            raise IndexError(f"Token id {int(bad)} is outside the vocabulary [0, {self.num_embeddings}) of the "
                             f"embedding: check the tokenizer against the model's vocab_size.")
        split = local_ids(ids, self.vocab_start, self.vocab_end)
        return combine_lookup(F.embedding(split.ids, self.weight, self.local_padding_idx), split.outside, self.tp_group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}), {self.embedding_dim}, "
                f"padding_idx={self.padding_idx}, rows=[{self.vocab_start}, {self.vocab_end}), "
                f"tp={self.tp_rank}/{self.tp_size}")


def vocab_parallel_lm_head(
    module: nn.Linear, tp: Axis, gather_output: bool, padded_vocab: int
) -> ColumnParallelLinear:
    """Column-parallel LM head padded like the VocabParallelEmbedding, so tied weights shard identically.

    The caller re-ties afterwards with `lm_head.weight = embedding.weight`.
    """
    return ColumnParallelLinear.from_native_module(module, tp, gather_output=gather_output,
                                                   padded_out_features=padded_vocab)
