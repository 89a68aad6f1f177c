"""`colossalai.nn.optimizer`. GaLoreAdamW8bit is refused (8-bit GaLore needs bitsandbytes' kernels)."""
from booster_plugin.compat import HybridAdam

from ..._refused import refused_class

__all__ = ["HybridAdam", "GaLoreAdamW8bit"]

GaLoreAdamW8bit = refused_class("GaLoreAdamW8bit", "GaLore's 8-bit AdamW is not implemented (bitsandbytes kernels); "
                                                   "use torch.optim.AdamW or HybridAdam.")
