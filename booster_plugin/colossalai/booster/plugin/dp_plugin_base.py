"""`colossalai.booster.plugin.dp_plugin_base`: the data-parallel plugins' base class."""
from booster_plugin.plugins.base import DPPluginBase

__all__ = ["DPPluginBase"]
