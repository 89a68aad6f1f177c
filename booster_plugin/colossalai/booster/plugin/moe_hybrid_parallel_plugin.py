"""`colossalai.booster.plugin.moe_hybrid_parallel_plugin`."""
from booster_plugin.plugins.moe import MoeHybridParallelPlugin

__all__ = ["MoeHybridParallelPlugin"]
