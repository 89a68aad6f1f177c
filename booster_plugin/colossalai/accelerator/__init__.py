"""`colossalai.accelerator`."""
from booster_plugin.compat import get_accelerator

__all__ = ["get_accelerator"]
