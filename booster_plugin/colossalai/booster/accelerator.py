"""`colossalai.booster.accelerator.Accelerator`: the device a Booster puts the model on ("cpu" or "cuda")."""
import torch
from torch import nn

__all__ = ["Accelerator"]


class Accelerator:
    def __init__(self, device: str) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"Accelerator({device!r}): supported devices are 'cpu' and 'cuda'.")
        self.device = device

    def bind(self) -> None:
        """Make the device the process's current one (CUDA: its current device)."""
        if self.device == "cuda":
            torch.cuda.set_device(torch.device("cuda", torch.cuda.current_device()))

    def configure_model(self, model: nn.Module) -> nn.Module:
        return model.to(torch.device(self.device))
