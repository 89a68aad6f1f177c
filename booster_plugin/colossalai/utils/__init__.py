"""`colossalai.utils`."""
import torch

from booster_plugin.compat import get_accelerator, set_seed

__all__ = ["get_current_device", "set_seed"]


def get_current_device() -> torch.device:
    """This rank's device: its accelerator (by LOCAL_RANK) when there is one, else the CPU."""
    return get_accelerator().get_current_device()
