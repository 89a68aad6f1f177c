"""Hugging Face `transformers.Trainer` on this library's plugins: `HybridParallelTrainer(model=..., args=
TrainingArguments(...), train_dataset=..., plugin=HybridParallelPlugin(tp_size=2, pp_size=2))`, or the mixin before
any Trainer subclass. Needs transformers' Trainer extras (accelerate)."""
import transformers
from packaging import version
from transformers import Trainer

# The overrides follow the Trainer of transformers 5.17 to 5.24 (its private hooks and loss scaling changed across
# 5.x releases: compat.py)
from .compat import MIN_TRANSFORMERS

if version.parse(transformers.__version__) < version.parse(MIN_TRANSFORMERS):
    raise ImportError(f"HybridParallelTrainer needs transformers>={MIN_TRANSFORMERS} (its Trainer hooks); this "
                      f"environment has {transformers.__version__}: pip install 'transformers>={MIN_TRANSFORMERS}'.")

from .mixin import HybridParallelTrainerMixin  # noqa: E402  (after the version check)


class HybridParallelTrainer(HybridParallelTrainerMixin, Trainer):
    """`transformers.Trainer` whose model and optimizer run on `plugin` (see HybridParallelTrainerMixin)."""


__all__ = ["HybridParallelTrainer", "HybridParallelTrainerMixin"]
