"""Falcon (hand-written: its fused `query_key_value` interleaves heads, which the structure does not tell from
concatenated q|k|v). The old architecture stores [q, k, v] per head, the new one (`new_decoder_architecture`) per
key/value group [q x (heads / kv heads), k, v]: a plain column split gives each rank whole heads (groups), in order,
when tp divides the key/value heads. Multi-query attention of the old architecture ([all q, one k, one v]) does not
split so, and is refused by the proof that runs at boost, as for an inferred policy (proven.py)."""
from ..split_heads_argument import SplitHeadsArgument
from .base import INPUT, Colwise, Rowwise, VocabEmbedding, VocabHead
from .proven import ProvenPolicy


class FalconPolicy(ProvenPolicy):
    layers = "h"
    entry = {"word_embeddings": INPUT}
    exit = ("ln_f",)
    tp_plan = {
        "word_embeddings": VocabEmbedding(),
        "h.*.self_attention.query_key_value": Colwise(),      # whole heads (key/value groups) per rank
        "h.*.self_attention.dense": Rowwise(),
        # with config.alibi: the bias (batch, heads, 1, keys) and the mask it is folded into, per head: own heads
        "h.*.self_attention": SplitHeadsArgument(("alibi", "attention_mask")),
        "h.*.mlp.dense_h_to_4h": Colwise(),
        "h.*.mlp.dense_4h_to_h": Rowwise(),
    }
    head_tp_plan = {"lm_head": VocabHead()}
    tp_attributes = {"h.*.self_attention": ("num_heads", "num_kv_heads")}
    tp_divisible = ("num_attention_heads", "num_kv_heads")
    local_rng_modules = ("h.*.self_attention.attention_dropout",)
