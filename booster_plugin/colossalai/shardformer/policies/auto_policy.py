"""`colossalai.shardformer.policies.auto_policy`."""
from shardformer.policies import get_autopolicy

__all__ = ["get_autopolicy"]
