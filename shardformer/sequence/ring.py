"""Sequence parallelism "ring_attn": the decoder layers run on this rank's two zigzag chunks of the sequence (rank r
of sp holds chunks r and 2 sp - 1 - r of 2 sp, so causal work is balanced) and attention is ring attention over the
sp group (shardformer/sequence/ring_attention.py: key/value blocks circulate, partial results merge by log-sum-exp),
registered in transformers' AttentionInterface in place of the model's own implementation; the rotary tables are cut
to the rank's chunks. In eval mode the layers run unsplit with the model's own attention."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from torch import Tensor, nn

from pipeline.context import Axis

from .ring_attention import RingAttention
from .ulysses import (AttentionFunction, ShardPositionEmbeddings, attention_override, layers_config, own_attention,
                      point_layers_at)

__all__ = ["RING", "use_ring_attention"]

RING = "hybrid_parallel_ring"  # the attention implementation name the ring_attn layers' attention sees


@dataclass(frozen=True)
class _Ring:
    """What the ring attention function keeps per module: the ring, and the module's own attention (eval mode)."""
    ring: RingAttention
    implementation: str
    eager: Optional[AttentionFunction]


def _ring_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                    **kwargs):
    if not module.training:  # the layers run unsplit
        return own_attention(module)(module, query, key, value, attention_mask, **kwargs)
    spec: _Ring = attention_override(module)
    return spec.ring(module, query, key, value, attention_mask, **kwargs)


def use_ring_attention(model: nn.Module, layers: Sequence[nn.Module], seq: Axis) -> None:
    """Point the layers' attention at ring attention over the `seq` axis and cut their rotary tables zigzag. The ring reads
    the mask the model's own forward built (sdpa's or eager's: a 4-D mask of the whole sequence, or None for a plain
    causal row), so it attends exactly where one process would (padding, packed documents, sliding windows)."""
    implementation = layers_config(model, layers)._attn_implementation
    if implementation not in ("sdpa", "eager"):
        raise NotImplementedError(f"sequence_parallelism_mode='ring_attn' reads the attention mask the model builds "
                                  f"for attn_implementation 'sdpa' or 'eager'; this model uses {implementation!r}, "
                                  f"whose masks (None, 2-D or block masks) would not tell it where documents or "
                                  f"padding are. Load the model with attn_implementation='sdpa'.")
    ring = RingAttention(seq.group)
    point_layers_at(model, layers, RING, _ring_attention, "ring_attn",
                    lambda implementation, eager: _Ring(ring, implementation, eager),
                    ShardPositionEmbeddings(seq.size, seq.rank, zigzag=True))
