"""Falcon (hand-written: its fused `query_key_value` interleaves heads, which the structure does not tell from
concatenated q|k|v). The old architecture stores [q, k, v] per head, the new one (`new_decoder_architecture`) per
key/value group [q x (heads / kv heads), k, v]: a plain column split gives each rank whole heads (groups), in order,
when tp divides the key/value heads. Multi-query attention of the old architecture (Falcon-7B, transformers' default
config) stores [all q, one k, one v], which a column split does not keep whole: there the projection stays whole on
every rank, each keeping its query heads and the one key and value (OwnHeads: gradients of the replicas and of its
input summed over tp), and only the query heads are divided by tp (the attention keeps its one key/value head).
Proven at boost by one forward of a small twin, as an inferred policy is (proven.py)."""
from types import MappingProxyType
from typing import Mapping, NamedTuple, Sequence

from ..tensor.split_heads_argument import SplitHeadsArgument
from .base import INPUT, Colwise, OwnHeads, ParallelStyle, Rowwise, VocabEmbedding, VocabHead
from .proven import ProvenPolicy

QKV, ATTENTION = "h.*.self_attention.query_key_value", "h.*.self_attention"


class FalconTP(NamedTuple):
    """The tensor-parallel part of Falcon's plan that depends on its attention layout (a value: never mutated)."""
    tp_plan: Mapping[str, ParallelStyle]
    tp_attributes: Mapping[str, Sequence[str]]
    tp_divisible: Sequence[str]


GROUPED = FalconTP(  # [q, k, v] per head or per key/value group: a column split keeps whole heads (groups)
    MappingProxyType({
        "word_embeddings": VocabEmbedding(),
        QKV: Colwise(),
        "h.*.self_attention.dense": Rowwise(),
        # with config.alibi: the bias (batch, heads, 1, keys) and the mask it is folded into, per head: own heads
        ATTENTION: SplitHeadsArgument(("alibi", "attention_mask")),
        "h.*.mlp.dense_h_to_4h": Colwise(),
        "h.*.mlp.dense_4h_to_h": Rowwise(),
    }),
    MappingProxyType({ATTENTION: ("num_heads", "num_kv_heads")}),
    ("num_attention_heads", "num_kv_heads"))


def falcon_tp(config) -> FalconTP:
    """The plan for the model's attention layout, a pure function of its config: multi-query of the old architecture
    (num_kv_heads is ignored: one key/value) keeps its projection whole and divides the query heads only."""
    if not (config.multi_query and not config.new_decoder_architecture):
        return GROUPED
    head_dim = config.hidden_size // config.num_attention_heads
    return FalconTP(MappingProxyType({**GROUPED.tp_plan, QKV: OwnHeads(config.num_attention_heads, tail=2 * head_dim)}),
                    MappingProxyType({ATTENTION: ("num_heads",)}), ("num_attention_heads",))


class FalconPolicy(ProvenPolicy):
    layers = "h"
    entry = {"word_embeddings": INPUT}
    exit = ("ln_f",)
    head_tp_plan = {"lm_head": VocabHead()}
    local_rng_modules = ("h.*.self_attention.attention_dropout",)

    def _tp(self) -> FalconTP:
        """The plan value for the bound model (the grouped layout before one is bound)."""
        return GROUPED if self.model is None else falcon_tp(self.model.config)

    @property
    def tp_plan(self) -> Mapping[str, ParallelStyle]:
        return self._tp().tp_plan

    @property
    def tp_attributes(self) -> Mapping[str, Sequence[str]]:
        return self._tp().tp_attributes

    @property
    def tp_divisible(self) -> Sequence[str]:
        return self._tp().tp_divisible
