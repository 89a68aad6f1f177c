"""`colossalai.shardformer.policies.auto_policy`: `get_autopolicy(model)` and the Policy base class (policies here
are derived from transformers' tp/pp plans, not hand-written per model)."""
from shardformer.policies import get_autopolicy
from shardformer.policies.base import Policy

__all__ = ["get_autopolicy", "Policy"]
