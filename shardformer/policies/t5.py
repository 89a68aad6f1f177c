"""T5 (T5ForConditionalGeneration, T5Model, T5EncoderModel): encoder and decoder stacks of blocks whose attention
has q/k/v/o and whose feed-forward has wi (or gated wi_0, wi_1) and wo; one `shared` embedding tied to both stacks'
`embed_tokens` and the LM head. The relative position bias is computed by the first block of each stack from a
(buckets, heads) table: split by heads, each rank computes its own heads' bias; `n_heads` (which sizes the zero
bias of cross-attention) is divided by tp.
"""
from .base import Colwise, HeadEmbedding, Policy, Rowwise, VocabEmbedding, VocabHead

_ATTENTION = ("*.block.*.layer.*.SelfAttention", "*.block.*.layer.*.EncDecAttention")


class T5Policy(Policy):
    tp_plan = {
        "shared": VocabEmbedding(),
        "encoder.embed_tokens": VocabEmbedding(),
        "decoder.embed_tokens": VocabEmbedding(),
        **{f"{a}.{x}": Colwise() for a in _ATTENTION for x in "qkv"},
        **{f"{a}.o": Rowwise() for a in _ATTENTION},
        "*.block.0.layer.0.SelfAttention.relative_attention_bias": HeadEmbedding(),
        "*.block.*.layer.*.DenseReluDense.wi": Colwise(),
        "*.block.*.layer.*.DenseReluDense.wi_0": Colwise(),
        "*.block.*.layer.*.DenseReluDense.wi_1": Colwise(),
        "*.block.*.layer.*.DenseReluDense.wo": Rowwise(),
        # T5ForConditionalGeneration computes its loss with CrossEntropyLoss over the full vocabulary
        "lm_head": VocabHead(gather_output=True),
    }
    tp_attributes = {a: ("n_heads",) for a in _ATTENTION}
    tp_divisible = ("num_heads", "d_ff")
    local_rng_modules = _ATTENTION  # attention-probability dropout acts on split heads

    def set_pipeline_stage_manager(self, stage_manager) -> None:
        if stage_manager is not None:
            raise NotImplementedError("T5 with pp_size > 1 is not implemented yet: use tp and dp (pp_size=1).")
        super().set_pipeline_stage_manager(stage_manager)
