"""`colossalai.nn.optimizer`."""
from booster_plugin.compat import HybridAdam

__all__ = ["HybridAdam"]
