"""`colossalai.kernel.kernel_loader`: refused (see the package)."""
from .._refused import refused_class

__all__ = ["FlashAttentionLoader", "FlashAttentionWithCustomMaskLoader"]

_REASON = "no kernel loaders here: attention uses transformers' attn_implementation (sdpa, flash_attention_2)."
FlashAttentionLoader = refused_class("FlashAttentionLoader", _REASON)
FlashAttentionWithCustomMaskLoader = refused_class("FlashAttentionWithCustomMaskLoader", _REASON)
