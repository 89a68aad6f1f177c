"""BERT encoders: q/k/v column, attention output and FFN output row; MLM decoder tied to word embeddings."""
from .base import INPUT, Colwise, Policy, Rowwise, VocabEmbedding, VocabHead


class BertPolicy(Policy):
    layers = "encoder.layer"
    entry = {"embeddings": INPUT}  # word + position + token-type embeddings, LayerNorm, dropout: stage 0 only
    exit = ("pooler",)
    tp_plan = {
        "embeddings.word_embeddings": VocabEmbedding(),
        "encoder.layer.*.attention.self.query": Colwise(),
        "encoder.layer.*.attention.self.key": Colwise(),
        "encoder.layer.*.attention.self.value": Colwise(),
        "encoder.layer.*.attention.output.dense": Rowwise(),
        "encoder.layer.*.intermediate.dense": Colwise(),
        "encoder.layer.*.output.dense": Rowwise(),
    }
    # BertForMaskedLM computes its loss with CrossEntropyLoss over the full vocabulary: gather the logits.
    head_tp_plan = {"cls.predictions.decoder": VocabHead(gather_output=True)}
    tp_attributes = {"encoder.layer.*.attention.self": ("num_attention_heads", "all_head_size")}
    tp_input_regions = ("encoder.layer.*.attention.self",)  # query/key/value share one input
    tp_divisible = ("num_attention_heads", "intermediate_size")
    local_rng_modules = ("encoder.layer.*.attention.self",)
