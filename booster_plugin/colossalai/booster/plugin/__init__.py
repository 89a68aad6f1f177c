"""`colossalai.booster.plugin`: the plugins this library implements (see docs/colossalai_inventory.md for the
others)."""
from booster_plugin import HybridParallelPlugin

from .plugin_base import Plugin

__all__ = ["HybridParallelPlugin", "Plugin"]
