"""`colossalai.booster`."""
from booster_plugin import Booster

from .plugin import Plugin

__all__ = ["Booster", "Plugin"]
