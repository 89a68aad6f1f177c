"""`colossalai.booster.plugin.hybrid_parallel_plugin`: the plugin and the model it boosts."""
from booster_plugin import HybridParallelModule, HybridParallelPlugin

__all__ = ["HybridParallelModule", "HybridParallelPlugin"]
