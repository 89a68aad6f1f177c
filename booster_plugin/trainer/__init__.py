"""Hugging Face `transformers.Trainer` on this library's plugins: `HybridParallelTrainer(model=..., args=
TrainingArguments(...), train_dataset=..., plugin=HybridParallelPlugin(tp_size=2, pp_size=2))`, or the mixin before
any Trainer subclass. Needs transformers' Trainer extras (accelerate)."""
from transformers import Trainer

from .mixin import HybridParallelTrainerMixin


class HybridParallelTrainer(HybridParallelTrainerMixin, Trainer):
    """`transformers.Trainer` whose model and optimizer run on `plugin` (see HybridParallelTrainerMixin)."""


__all__ = ["HybridParallelTrainer", "HybridParallelTrainerMixin"]
