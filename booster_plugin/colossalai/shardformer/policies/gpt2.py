"""`colossalai.shardformer.policies.gpt2`."""
from shardformer.policies.gpt2 import GPT2Policy

__all__ = ["GPT2Policy"]
