"""`colossalai.booster.plugin.dp_plugin_base`: the data-parallel plugins' base class."""
from booster_plugin.plugin_base import DPPluginBase

__all__ = ["DPPluginBase"]
