"""`colossalai.cluster`."""
from booster_plugin.compat import DistCoordinator

__all__ = ["DistCoordinator"]
