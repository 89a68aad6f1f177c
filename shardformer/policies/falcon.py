"""Falcon (hand-written: its fused `query_key_value` interleaves heads, which the structure does not tell from
concatenated q|k|v). The old architecture stores [q, k, v] per head, the new one (`new_decoder_architecture`) per
key/value group [q x (heads / kv heads), k, v]: a plain column split gives each rank whole heads (groups), in order,
when tp divides the key/value heads. Multi-query attention of the old architecture (Falcon-7B, transformers' default
config) stores [all q, one k, one v], which a column split does not keep whole: there the projection stays whole on
every rank, each keeping its query heads and the one key and value (OwnHeads: gradients of the replicas and of its
input summed over tp), and only the query heads are divided by tp (the attention keeps its one key/value head).
Proven at boost by one forward of a small twin, as an inferred policy is (proven.py)."""
from ..tensor.split_heads_argument import SplitHeadsArgument
from .base import INPUT, Colwise, OwnHeads, Rowwise, VocabEmbedding, VocabHead
from .proven import ProvenPolicy

QKV, ATTENTION = "h.*.self_attention.query_key_value", "h.*.self_attention"


class FalconPolicy(ProvenPolicy):
    layers = "h"
    entry = {"word_embeddings": INPUT}
    exit = ("ln_f",)
    tp_plan = {
        "word_embeddings": VocabEmbedding(),
        QKV: Colwise(),      # whole heads (key/value groups) per rank; multi-query: see set_model
        "h.*.self_attention.dense": Rowwise(),
        # with config.alibi: the bias (batch, heads, 1, keys) and the mask it is folded into, per head: own heads
        ATTENTION: SplitHeadsArgument(("alibi", "attention_mask")),
        "h.*.mlp.dense_h_to_4h": Colwise(),
        "h.*.mlp.dense_4h_to_h": Rowwise(),
    }
    head_tp_plan = {"lm_head": VocabHead()}
    tp_attributes = {ATTENTION: ("num_heads", "num_kv_heads")}
    tp_divisible = ("num_attention_heads", "num_kv_heads")
    local_rng_modules = ("h.*.self_attention.attention_dropout",)

    def set_model(self, model) -> None:
        """The plan for the model's attention layout: multi-query (old architecture) keeps its projection whole."""
        super().set_model(model)
        config, cls = model.config, type(self)
        if config.multi_query and not config.new_decoder_architecture:  # num_kv_heads is ignored: one key/value
            head_dim = config.hidden_size // config.num_attention_heads
            self.tp_plan = {**cls.tp_plan, QKV: OwnHeads(config.num_attention_heads, tail=2 * head_dim)}
            self.tp_attributes, self.tp_divisible = {ATTENTION: ("num_heads",)}, ("num_attention_heads",)
        else:
            self.tp_plan, self.tp_attributes, self.tp_divisible = cls.tp_plan, cls.tp_attributes, cls.tp_divisible
