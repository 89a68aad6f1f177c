"""Tensor-parallel building blocks: autograd collectives, parallel layers, sharding specs, loss and dropout RNG."""
from .comm import (all_to_all, copy_to_tp, gather_from_sequence, gather_from_tp, get_tp_rank, get_tp_world_size,
                   reduce_from_tp, reduce_scatter_to_sequence, split_to_tp)
from .dropout import TPRNGTracker, wrap_module_forward_in_local_rng
from .embedding import VocabParallelEmbedding, vocab_parallel_lm_head
from .linear import ColumnParallelLinear, RowParallelLinear
from .loss import parallel_causal_lm_loss, vocab_parallel_cross_entropy
from .sequence_shard import SequenceShard
from .spec import TPSpec, gather_tensor, get_tp_spec, padded_size, set_tp_spec, shard_parameter, shard_tensor

__all__ = [
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "split_to_tp",
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "all_to_all",
    "SequenceShard",
    "get_tp_world_size",
    "get_tp_rank",
    "TPSpec",
    "set_tp_spec",
    "get_tp_spec",
    "padded_size",
    "shard_tensor",
    "gather_tensor",
    "shard_parameter",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_lm_head",
    "vocab_parallel_cross_entropy",
    "parallel_causal_lm_loss",
    "TPRNGTracker",
    "wrap_module_forward_in_local_rng",
]
