"""The KV cache of one pipeline stage: transformers' `DynamicCache`, whose length queries a stage can answer.

Each stage fills the cache entries of the layers it holds (its attention modules call `cache.update(..., layer_idx)`
with their HF index). transformers asks a cache for lengths by layer index, mostly layer 0's: the base model's
`cache.get_seq_length()` (positions), the masks' `get_query_offset` / `get_mask_sizes(q, layer_idx)` (layer 0, or the
first full-attention / sliding layer), `generate`'s prefill. On a stage that does not hold that layer its entry stays
empty, so it would answer 0 and build positions and masks for an empty past. A `StageCache` answers such a query with
a held layer of the same kind (full, sliding, ...), which has seen every token the asked one has on the stage that
holds it; everything else is DynamicCache's own.
"""
from __future__ import annotations

from typing import FrozenSet, Sequence, Tuple

from transformers.cache_utils import DynamicCache

__all__ = ["StageCache"]


class StageCache(DynamicCache):
    """A DynamicCache holding the entries of the layers `held` (HF indices) of this pipeline stage."""

    def __init__(self, held: Sequence[int], *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held: FrozenSet[int] = frozenset(held)

    @classmethod
    def adopt(cls, cache: DynamicCache, held: Sequence[int]) -> "StageCache":
        """A StageCache over the state of `cache` (the same layer entries, shared; e.g. the one `generate` made)."""
        stage_cache = cls.__new__(cls)
        vars(stage_cache).update(vars(cache))
        stage_cache.held = frozenset(held)
        return stage_cache

    def _kind(self, layer_idx: int) -> Tuple[type, bool]:
        layer = self.layers[layer_idx]
        return type(layer), bool(getattr(layer, "is_sliding", False))

    def _answering(self, layer_idx: int) -> int:
        """The layer whose entry answers length queries about `layer_idx`: itself if held, else the first held layer
        of its kind (else the first held layer: no held layer reads a mask of that kind)."""
        if layer_idx in self.held or not self.held or layer_idx >= len(self.layers):
            return layer_idx
        present = sorted(i for i in self.held if i < len(self.layers))
        if not present:  # entries are created lazily: none of this stage's exists yet, so the past is empty
            return layer_idx
        kind = self._kind(layer_idx)
        return next((i for i in present if self._kind(i) == kind), present[0])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(self._answering(layer_idx))

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return super().get_mask_sizes(query_length, self._answering(layer_idx))
