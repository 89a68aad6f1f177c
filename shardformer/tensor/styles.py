"""Tensor-parallel styles: what a plan entry asks of the module (or raw parameter) it names. Plans are data: each
style is a frozen value; the sharder's style table (apply_styles.py) says what each does to a module."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Colwise", "Rowwise", "GradAllReduce", "VocabEmbedding", "VocabHead", "HeadEmbedding", "OwnHeads",
           "KVHeads", "SharedTailGrad", "SplitParam", "Experts", "ParallelStyle"]


@dataclass(frozen=True)
class Colwise:
    """Output features split over tp ranks; `n_fused` areas (e.g. q, k, v of a fused projection) split each."""
    n_fused: int = 1
    gather_output: bool = False


@dataclass(frozen=True)
class Rowwise:
    """Input features split over tp ranks; the output is all-reduced and the bias added once. With `split_input`
    the layer receives the full (replicated) input and keeps its own chunk."""
    split_input: bool = False


@dataclass(frozen=True)
class GradAllReduce:
    """Replicated parameters that see only this rank's part of a split activation (e.g. a per-head q/k norm after
    a column-parallel projection): their gradients are summed over the tp ranks."""


@dataclass(frozen=True)
class VocabEmbedding:
    """Embedding rows (the vocabulary) split over tp ranks, padded to a multiple of tp."""


@dataclass(frozen=True)
class VocabHead:
    """LM head split over the vocabulary; the loss is a vocab-parallel cross-entropy unless `gather_output`."""
    gather_output: bool = False


@dataclass(frozen=True)
class HeadEmbedding:
    """Embedding columns (e.g. T5's relative position bias, one per head) split over tp ranks; no communication."""


@dataclass(frozen=True)
class OwnHeads:
    """A projection kept whole on every rank whose output holds `num_heads` equal heads, then `tail` features every
    rank's heads use whole (the one key and value of multi-query attention): each rank keeps its share of the heads
    (with fewer heads than ranks, the one its query heads attend to) and the tail; gradients of the replicas are
    summed, its input's gradient too."""
    num_heads: int
    tail: int = 0


@dataclass(frozen=True)
class KVHeads(OwnHeads):
    """A key/value projection with fewer heads than tp ranks: kept whole on every rank, each rank uses the head of
    its query heads; gradients of the replicas are summed."""


@dataclass(frozen=True)
class SharedTailGrad:
    """A replicated projection whose output's last `features` features every rank's heads use alike (the shared
    rotary key of multi-head latent attention): their gradient, each rank's from its heads only, is summed."""
    features: int


@dataclass(frozen=True)
class SplitParam:
    """A raw parameter (per-head attention sinks, a mixture's stacked expert weights) split along `dim` over tp
    ranks, in `n_fused` equal areas each split separately (an expert's gate|up)."""
    dim: int = 0
    n_fused: int = 1


@dataclass(frozen=True)
class Experts:
    """Mixture-of-experts experts whose stacked weights are split over tp ranks (each rank computes its part of
    every expert): their output is summed over tp, the gradients of their input and routing weights too."""


ParallelStyle = (Colwise | Rowwise | GradAllReduce | OwnHeads | SharedTailGrad | SplitParam | Experts | VocabEmbedding
                 | VocabHead | HeadEmbedding)
