"""Tensor parallelism as plans: the styles a plan names (styles.py), their application to a model (apply_styles.py,
over the parallel layers in shardformer/layer/), the regions that enter and leave the tp group (regions.py), LoRA
layers sharded with their base (lora_sharding.py) and head counts passed as call arguments (split_heads_argument.py)."""
