"""`colossalai.accelerator`: ColossalAI's accelerator API (booster_plugin/compat/accelerator.py: one Accelerator class for
every device, with CudaAccelerator and CpuAccelerator as ColossalAI names them; BaseAccelerator is their base)."""
from booster_plugin.compat.accelerator import (Accelerator, CpuAccelerator, CudaAccelerator, auto_set_accelerator,
                                        get_accelerator, set_accelerator)

__all__ = ["get_accelerator", "set_accelerator", "auto_set_accelerator", "BaseAccelerator", "CudaAccelerator",
           "CpuAccelerator"]

BaseAccelerator = Accelerator
