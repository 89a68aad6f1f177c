"""`colossalai.booster.plugin.gemini_plugin`: GeminiPlugin, on torch FSDP2 (booster_plugin/fsdp.py)."""
from booster_plugin.fsdp import GeminiPlugin

__all__ = ["GeminiPlugin"]
