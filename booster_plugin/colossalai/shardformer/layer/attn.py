"""`colossalai.shardformer.layer.attn`: refused (see the package's docstring)."""
from . import AttnMaskType, ColoAttention, RingAttention
from ..._refused import refused_function

__all__ = ["AttnMaskType", "ColoAttention", "RingAttention", "invert_mask"]

invert_mask = refused_function("invert_mask", "attention masks are the model's own (transformers').")
