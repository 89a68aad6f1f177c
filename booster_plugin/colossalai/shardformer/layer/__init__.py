"""`colossalai.shardformer.layer`: ColossalAI's parallel layers.

Linear1D_Col, Linear1D_Row and VocabParallelEmbedding1D are this library's ColumnParallelLinear, RowParallelLinear
and VocabParallelEmbedding with ColossalAI's arguments (linear.py); FusedLayerNorm's `from_native_module` returns the
LayerNorm itself (ColossalAI swaps in apex's fused kernel, numerically the same). The others are refused with the
reason: HybridParallelPlugin shards the model's own modules itself (fused q/k/v projections, dropout, attention,
the vocab-parallel loss) and no script needs to build them by hand.
"""
from torch import nn

from ..._refused import refused_class, refused_function
from .linear import Linear1D_Col, Linear1D_Row, VocabParallelEmbedding1D
from .utils import Randomizer

__all__ = ["Linear1D_Col", "Linear1D_Row", "VocabParallelEmbedding1D", "FusedLayerNorm", "Randomizer", "Embedding1D",
           "LinearWithGradAccum", "FusedLinear", "FusedLinear1D_Col", "FusedLinear1D_Row", "GPT2FusedLinearConv",
           "GPT2FusedLinearConv1D_Col", "GPT2FusedLinearConv1D_Row", "DropoutForParallelInput",
           "DropoutForReplicatedInput", "ColoAttention", "AttnMaskType", "RingAttention", "cross_entropy_1d",
           "dist_log_prob_1d", "all_to_all_comm"]


class FusedLayerNorm:
    """ColossalAI's fused LayerNorm: `from_native_module(ln)` gives the LayerNorm back (same results)."""

    @staticmethod
    def from_native_module(module: nn.LayerNorm, *args: object, **kwargs: object) -> nn.LayerNorm:
        return module


_BY_PLUGIN = ("HybridParallelPlugin's policy applies it to the model's own modules (boost the model); it is not "
              "built by hand here.")
Embedding1D = refused_class("Embedding1D", "embeddings are split by vocabulary only (VocabParallelEmbedding1D); "
                                           "a split of the embedding dimension is not implemented.")
LinearWithGradAccum = refused_class("LinearWithGradAccum", "gradient-accumulation fusion is a CUDA kernel of "
                                                           "ColossalAI's; plain nn.Linear gives the same results.")
FusedLinear = refused_class("FusedLinear", _BY_PLUGIN)
FusedLinear1D_Col = refused_class("FusedLinear1D_Col", _BY_PLUGIN)
FusedLinear1D_Row = refused_class("FusedLinear1D_Row", _BY_PLUGIN)
GPT2FusedLinearConv = refused_class("GPT2FusedLinearConv", _BY_PLUGIN)
GPT2FusedLinearConv1D_Col = refused_class("GPT2FusedLinearConv1D_Col", _BY_PLUGIN)
GPT2FusedLinearConv1D_Row = refused_class("GPT2FusedLinearConv1D_Row", _BY_PLUGIN)
DropoutForParallelInput = refused_class("DropoutForParallelInput", "dropout under tensor parallelism draws from "
                                                                   "the plugin's RNG tracker around the model's "
                                                                   "forward; the model's own nn.Dropout is kept.")
DropoutForReplicatedInput = refused_class("DropoutForReplicatedInput", "as DropoutForParallelInput")
ColoAttention = refused_class("ColoAttention", "attention runs as the model's own (transformers' attention "
                                               "functions, sdpa or flash); no separate kernel wrapper.")
AttnMaskType = refused_class("AttnMaskType", "as ColoAttention")
RingAttention = refused_class("RingAttention", "ring attention runs inside HybridParallelPlugin("
                                               "sequence_parallelism_mode='ring_attn').")
cross_entropy_1d = refused_function("cross_entropy_1d", "the vocab-parallel loss is applied by the plugin "
                                                        "(shardformer.layer.vocab_parallel_cross_entropy).")
dist_log_prob_1d = refused_function("dist_log_prob_1d", "no vocab-parallel log-probability helper here.")
all_to_all_comm = refused_function("all_to_all_comm", "Ulysses all-to-all runs inside HybridParallelPlugin("
                                                      "sequence_parallelism_mode='all_to_all').")
