"""`colossalai.shardformer.layer.qkv_fused_linear`: refused (fused q/k/v are sharded by the plugin's policy)."""
from ..._refused import refused_function

__all__ = ["split_fused_qkv_in_gpt2_style"]

split_fused_qkv_in_gpt2_style = refused_function(
    "split_fused_qkv_in_gpt2_style", "GPT-2's fused c_attn is split by the plugin (ColumnParallelLinear with n_fused=3).")
