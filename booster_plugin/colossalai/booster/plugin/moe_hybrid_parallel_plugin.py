"""`colossalai.booster.plugin.moe_hybrid_parallel_plugin`."""
from booster_plugin.moe_plugin import MoeHybridParallelPlugin

__all__ = ["MoeHybridParallelPlugin"]
