"""`colossalai.booster.plugin.plugin_base`: the base class every plugin of this library derives from."""
from booster_plugin.plugins.base import Plugin

__all__ = ["Plugin"]
