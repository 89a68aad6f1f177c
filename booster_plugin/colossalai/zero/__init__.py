"""`colossalai.zero`: LowLevelZeroOptimizer is the optimizer LowLevelZeroPlugin boosts (this library's
ZeroOptimizer, ZeRO-1/2 over the data-parallel group)."""
from booster_plugin.core.zero import ZeroOptimizer as LowLevelZeroOptimizer

__all__ = ["LowLevelZeroOptimizer"]
