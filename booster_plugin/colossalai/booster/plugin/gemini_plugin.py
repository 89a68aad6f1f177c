"""`colossalai.booster.plugin.gemini_plugin`: GeminiPlugin, on torch FSDP2 (booster_plugin/plugins/fsdp.py)."""
from booster_plugin.plugins.fsdp import GeminiPlugin

__all__ = ["GeminiPlugin"]
