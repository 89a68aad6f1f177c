"""`colossalai.booster.plugin.torch_ddp_plugin`."""
from booster_plugin import TorchDDPPlugin

__all__ = ["TorchDDPPlugin"]
