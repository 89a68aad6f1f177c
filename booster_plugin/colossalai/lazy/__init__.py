"""`colossalai.lazy`."""
from booster_plugin.compat import LazyInitContext

__all__ = ["LazyInitContext"]
