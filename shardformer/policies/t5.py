"""T5 (T5ForConditionalGeneration, T5Model; T5EncoderModel and its heads: the encoder alone): encoder and decoder stacks of blocks whose attention has q/k/v/o and
whose feed-forward has wi (or gated wi_0, wi_1) and wo; one `shared` embedding tied to both stacks' `embed_tokens`
and the LM head. The relative position bias is computed by the first block of each stack from a (buckets, heads)
table: under tp it is split by heads (each rank computes its own heads' bias) and `n_heads` (which sizes the zero
bias of cross-attention) is divided; under pp it is carried from stage to stage with the hidden states.
"""
from .encoder_decoder import SKIP_FIRST, EncoderDecoderPolicy
from .base import IDENTITY, INPUT, Colwise, HeadEmbedding, Rowwise, VocabEmbedding, VocabHead

_ATTENTION = ("*.block.*.layer.*.SelfAttention", "*.block.*.layer.*.EncDecAttention")


class T5Policy(EncoderDecoderPolicy):
    encoder_layers, decoder_layers = "encoder.block", "decoder.block"
    # T5Stack calls one `dropout` on the embeddings and again after its final norm
    encoder_entry = {"shared": IDENTITY, "encoder.embed_tokens": INPUT, "encoder.dropout": SKIP_FIRST}
    decoder_entry = {"decoder.embed_tokens": INPUT, "decoder.dropout": SKIP_FIRST}
    encoder_exit = ("encoder.final_layer_norm",)
    decoder_exit = ("decoder.final_layer_norm", "lm_head")
    carried = {"position_bias": (2, 1)}  # T5Block(hidden, mask, position_bias, ...) -> (hidden, position_bias, ..)
    tp_plan = {
        "shared": VocabEmbedding(),
        "encoder.embed_tokens": VocabEmbedding(),
        "decoder.embed_tokens": VocabEmbedding(),
        **{f"{a}.{x}": Colwise() for a in _ATTENTION for x in "qkv"},
        **{f"{a}.o": Rowwise() for a in _ATTENTION},
        "*.block.*.layer.0.SelfAttention.relative_attention_bias": HeadEmbedding(),
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


class T5EncoderPolicy(T5Policy):
    """T5EncoderModel (and T5ForTokenClassification around it): T5Policy's encoder, no decoder stack."""
    decoder_layers, decoder_entry, decoder_exit = "", {}, ()
    tp_plan = {path: style for path, style in T5Policy.tp_plan.items()
               if path not in ("decoder.embed_tokens", "lm_head")}
