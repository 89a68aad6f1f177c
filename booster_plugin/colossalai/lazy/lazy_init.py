"""`colossalai.lazy.lazy_init`."""
from booster_plugin.compat import LazyInitContext

__all__ = ["LazyInitContext"]
