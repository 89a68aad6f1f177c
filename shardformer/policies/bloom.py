"""BLOOM (hand-written: its fused `query_key_value` interleaves heads, [h0 q, k, v, h1 q, k, v, ...], which the
structure does not tell from concatenated q|k|v, so inference refuses it). A plain column split of that output gives
each rank whole heads' q, k, v blocks, in order: Colwise with one fused area. Proven by one forward at boost like an
inferred policy (proven.py)."""
from ..tensor.split_heads_argument import SplitHeadsArgument
from .base import IDENTITY, INPUT, Colwise, Rowwise, VocabEmbedding, VocabHead
from .proven import ProvenPolicy


class BloomPolicy(ProvenPolicy):
    layers = "h"
    entry = {"word_embeddings": INPUT, "word_embeddings_layernorm": IDENTITY}
    exit = ("ln_f",)
    tp_plan = {
        "word_embeddings": VocabEmbedding(),
        "h.*.self_attention.query_key_value": Colwise(),      # whole heads per rank: [q, k, v] of each
        "h.*.self_attention.dense": Rowwise(),
        "h.*.self_attention": SplitHeadsArgument(("alibi",), dim=0),  # ALiBi (batch * heads, 1, keys): own heads
        "h.*.mlp.dense_h_to_4h": Colwise(),
        "h.*.mlp.dense_4h_to_h": Rowwise(),
    }
    head_tp_plan = {"lm_head": VocabHead()}
    # its attention reads the query length from its input: under split_gather it gathers the sequence at its entry
    tp_input_regions = ("h.*.self_attention",)
    tp_attributes = {"h.*.self_attention": ("num_heads",)}    # it reshapes with num_heads
    tp_divisible = ("num_attention_heads",)
    # attention probabilities of split heads: per-rank masks (its output dropout acts on whole hidden states)
    local_rng_modules = ("h.*.self_attention.attention_dropout",)
