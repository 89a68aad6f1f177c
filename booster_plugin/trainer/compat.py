"""The transformers releases the Trainer integration follows (5.17 to 5.24) and where their Trainers differ for it.

- 5.19: Trainer divides its world-gathered `num_items_in_batch` by `get_tp_size()` (the ranks sharing one batch,
  which the mixin answers as tp x pp x sp) and scales the loss by world / `get_tp_size()`; 5.17 and 5.18 divide by
  accelerate's `parallelism_config` sizes only (unset here), so their count holds each replica's items once per rank
  of that replica and their scale is the world size (the mixin divides both back: a loss term that the count does
  not normalise, such as a MoE router loss, would otherwise be scaled by tp x pp x sp).
- The `gradient_checkpointing` training argument (5.17 to 5.20 at least) is `activation_checkpointing` in 5.24.
- `Trainer.loss_is_scaled_for_ga` (the subclass's say on gradient-accumulation scaling) exists from 5.19.
"""
from __future__ import annotations

import transformers
from packaging import version
from transformers import TrainingArguments

MIN_TRANSFORMERS = "5.17"
COUNT_DIVIDED_BY_TP_SIZE = version.parse(transformers.__version__) >= version.parse("5.19")


def activation_checkpointing(args: TrainingArguments) -> bool:
    """Whether the arguments ask Trainer to checkpoint activations (under either release's name)."""
    return bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))


def checkpointing_argument() -> str:
    """The name of this release's activation-checkpointing training argument."""
    return "activation_checkpointing" if hasattr(TrainingArguments, "activation_checkpointing") else \
        "gradient_checkpointing"
