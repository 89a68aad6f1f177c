"""`colossalai.booster.plugin.Plugin`: the type that scripts annotate a plugin argument with."""
from abc import ABC

from booster_plugin import HybridParallelPlugin

__all__ = ["Plugin"]


class Plugin(ABC):
    """Any Booster plugin: `isinstance(plugin, Plugin)` holds for every plugin of this library (registered below)."""


Plugin.register(HybridParallelPlugin)
