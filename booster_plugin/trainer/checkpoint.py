"""Trainer's model saving and checkpoints through the booster (collective: every rank calls them, each writes or
reads only its shards). `save_model` writes a Hugging Face directory (`from_pretrained` loads it); a Trainer
checkpoint holds that directory's files, the optimizer state (`optimizer/`, by parameter name: loadable into any
layout) and Trainer's own files (scheduler, trainer state, RNG states), which Trainer writes as usual.
`load_best_model_at_end` loads the best checkpoint's model the same way."""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

OPTIMIZER_DIR = "optimizer"


class CheckpointHooks:
    """Trainer's save/load hooks on the booster; mixed into HybridParallelTrainerMixin (needs `booster`,
    `model_wrapped`, `optimizer`, `lr_scheduler`, `args`, `processing_class`)."""

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The whole model as a Hugging Face directory (collective), then, on the main process, the processing
        class and the training arguments, as Trainer saves them."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.booster.save_model(self.model_wrapped, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.booster.save_optimizer(self.optimizer, os.path.join(output_dir, OPTIMIZER_DIR))
        if self.args.should_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's "save the optimizer too" reminder
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self.booster.load_model(self.model_wrapped, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`: the best checkpoint's model, through the booster's collective load."""
        self.booster.load_model(self.model_wrapped, self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        self.booster.load_optimizer(self.optimizer, os.path.join(checkpoint, OPTIMIZER_DIR))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
