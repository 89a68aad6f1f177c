"""`colossalai.booster.plugin.low_level_zero_plugin`."""
from booster_plugin import LowLevelZeroPlugin

__all__ = ["LowLevelZeroPlugin"]
