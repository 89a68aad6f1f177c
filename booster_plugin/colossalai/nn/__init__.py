"""`colossalai.nn`: its optimizers and learning-rate schedulers (ColossalAI re-exports both here)."""
from .lr_scheduler import CosineAnnealingWarmupLR, LinearWarmupLR
from .optimizer import HybridAdam

__all__ = ["CosineAnnealingWarmupLR", "HybridAdam", "LinearWarmupLR"]
