"""`colossalai.testing.random.seed_all`."""
import torch

from booster_plugin.compat import set_seed

__all__ = ["seed_all"]


def seed_all(seed: int, cuda_deterministic: bool = False) -> None:
    """Seed Python's, NumPy's and torch's generators (every device's); `cuda_deterministic` selects cuDNN's
    deterministic kernels, as ColossalAI's (otherwise its autotuned ones)."""
    set_seed(seed)
    torch.backends.cudnn.deterministic = cuda_deterministic
    torch.backends.cudnn.benchmark = not cuda_deterministic
