"""`colossalai.booster.plugin.torch_fsdp_plugin`: TorchFSDPPlugin, on torch FSDP2 (booster_plugin/plugins/fsdp.py)."""
from booster_plugin.plugins.fsdp import TorchFSDPPlugin

__all__ = ["TorchFSDPPlugin"]
