"""`colossalai.booster.plugin.torch_fsdp_plugin`: TorchFSDPPlugin, on torch FSDP2 (booster_plugin/fsdp.py)."""
from booster_plugin.fsdp import TorchFSDPPlugin

__all__ = ["TorchFSDPPlugin"]
