"""TRL's trainers on the plugin, ready made: `HybridParallelSFTTrainer(model=..., args=SFTConfig(...),
train_dataset=..., peft_config=..., plugin=HybridParallelPlugin(tp_size=2, pp_size=2))` and `HybridParallelDPOTrainer
(model=..., ref_model=..., args=DPOConfig(...), ..., plugin=...)`: the mixin before TRL's own trainer, which is all
they are (`class X(HybridParallelTrainerMixin, SFTTrainer)` is the same). What TRL needs from the plugin:
trl_support.py. Importing this module imports trl."""
from trl import DPOTrainer, SFTTrainer

from .mixin import HybridParallelTrainerMixin


class HybridParallelSFTTrainer(HybridParallelTrainerMixin, SFTTrainer):
    """TRL's `SFTTrainer` whose model and optimizer run on `plugin` (see HybridParallelTrainerMixin)."""


class HybridParallelDPOTrainer(HybridParallelTrainerMixin, DPOTrainer):
    """TRL's `DPOTrainer` whose policy, reference model and optimizer run on `plugin` (pp_size=1)."""


__all__ = ["HybridParallelSFTTrainer", "HybridParallelDPOTrainer"]
