"""`colossalai.kernel`: ColossalAI's CUDA kernel loaders are refused (attention runs through transformers' own
implementations: sdpa, flash_attention_2 where installed)."""
