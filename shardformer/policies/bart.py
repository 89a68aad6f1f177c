"""BART (BartForConditionalGeneration, BartModel): encoder and decoder layers with q/k/v/out projections and fc1/fc2;
learned positions and an embeddings LayerNorm before the layers of each stack."""
from typing import Dict

from .encoder_decoder import EncoderDecoderPolicy
from .base import IDENTITY, INPUT, ZEROS, Colwise, Rowwise


class BartPolicy(EncoderDecoderPolicy):
    """BART (BartForConditionalGeneration, BartModel): learned positions, embeddings LayerNorm; embeddings and the
    tied LM head stay replicated under tp (BartScaledWordEmbedding scales inside its forward)."""
    encoder_layers, decoder_layers = "encoder.layers", "decoder.layers"
    encoder_entry = {"shared": IDENTITY, "encoder.embed_tokens": INPUT, "encoder.embed_positions": ZEROS,
                     "encoder.layernorm_embedding": IDENTITY}
    decoder_entry = {"decoder.embed_tokens": INPUT, "decoder.embed_positions": ZEROS,
                     "decoder.layernorm_embedding": IDENTITY}
    # each stack drops its embeddings out functionally with its `dropout`: not again on received hidden states
    entry_attributes: Dict[str, Dict[str, object]] = {"encoder": {"dropout": 0.0}, "decoder": {"dropout": 0.0}}
    tp_plan = {
        **{f"{s}.layers.*.{a}.{x}_proj": Colwise() for s, a in (("encoder", "self_attn"), ("decoder", "self_attn"),
                                                                ("decoder", "encoder_attn")) for x in "qkv"},
        **{f"{s}.layers.*.{a}.out_proj": Rowwise() for s, a in (("encoder", "self_attn"), ("decoder", "self_attn"),
                                                                ("decoder", "encoder_attn"))},
        "*.layers.*.fc1": Colwise(),
        "*.layers.*.fc2": Rowwise(),
    }
    tp_divisible = ("encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim")
    local_rng_modules = ("*.layers.*.self_attn", "decoder.layers.*.encoder_attn")
