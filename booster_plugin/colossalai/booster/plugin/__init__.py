"""`colossalai.booster.plugin`: the plugins this library implements (see docs/colossalai_inventory.md for the
others)."""
from booster_plugin import (DPPluginBase, HybridParallelPlugin, LowLevelZeroPlugin, MoeHybridParallelPlugin, Plugin,
                            TorchDDPPlugin)
from booster_plugin.plugins.fsdp import GeminiPlugin, TorchFSDPPlugin

__all__ = ["DPPluginBase", "HybridParallelPlugin", "LowLevelZeroPlugin", "MoeHybridParallelPlugin", "Plugin",
           "TorchDDPPlugin", "GeminiPlugin", "TorchFSDPPlugin"]
