"""`transformers.Trainer` on a HybridParallelPlugin: Trainer's loop, logging, callbacks, optimizer and scheduler
creation are kept; the model and optimizer go through `Booster.boost`, and the few places where Trainer assumes
one replica per process (data sharding, loss scaling, gradient clipping, backward, saving) are mapped onto the plugin.

Overrides (each of the installed Trainer, transformers 5.x), and why:
- `__init__`: Trainer's own optimizer (weight-decay groups) built on the whole model, then the model and optimizer
  boosted; refuses the Trainer options that would act on the unsharded model behind the plugin's back.
- `_prepare_for_training`: instead of `accelerator.prepare` (a DDP wrap over the world): the scheduler on the
  boosted optimizer, checkpoint state loaded.
- `_wrap_model`: the boosted model for evaluation too (never accelerate's).
- `_get_dataloader`: sharded over data-parallel replicas, not over the world (data.py).
- `get_tp_size`: the ranks that share one replica's batches (tp x pp x sp), which Trainer divides out of its
  world-gathered `num_items_in_batch` and of its loss scaling for data parallel (from transformers 5.19; before,
  `_get_num_items_in_batch` and `_unscale_world_loss` do it: compat.py).
- `training_step`: `booster.backward` (pp = 1) or one `execute_pipeline` per accumulation window (pipeline_step.py).
- `_clip_grad_norm` / `_get_grad_norm` / `_maybe_log_save_evaluate`: the boosted optimizer clips the global norm
  (over tp, pp, dp slices) inside its step, with `max_grad_norm`; the logged norm is the one it measured.
- `prediction_step`: under pp, a forward-only pipeline step: its loss, and the full logits broadcast from the last
  stage for `compute_metrics` / `predict()`.
- `gather_function` (a property: Trainer assigns it): evaluation results gathered over replicas, not processes.
- `save_model`, the checkpoint hooks and `_load_best_model`: the booster's collective save/load (checkpoint.py).
- TRL's SFTTrainer / DPOTrainer: compute_loss gets the boosted model answering TRL's fused-LM-head calls, DPO's
  reference model is boosted too, and TRL's options the plugin cannot run are refused (trl_support.py); DPO's
  pipeline step (dpo_pipeline.py).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer

from pipeline.step import MicroBatch

from .. import Booster
from .checkpoint import CheckpointHooks
from .compat import COUNT_DIVIDED_BY_TP_SIZE, activation_checkpointing, checkpointing_argument
from .data import Replica, dataloader_params, replica_dataloader
from .gather import Nested, gather_replicas, replica_representatives
from .pipeline_step import AccumulationWindow, concat_batches, logits_on_every_stage, pipeline_loss
from .dpo_pipeline import dpo_pipeline_loss, dpo_pipeline_problems
from .trl_support import FusedHeadOnPlugin, attach, is_trl, is_trl_trainer, trl_problems


class HybridParallelTrainerMixin(CheckpointHooks):
    """Put before a `transformers.Trainer` subclass: `class MyTrainer(HybridParallelTrainerMixin, SFTTrainer)`.
    Takes the Trainer's arguments and `plugin` (a HybridParallelPlugin)."""

    def __init__(self, *args: Any, plugin, **kwargs: Any) -> None:
        for needed in ("dp_size", "dp_rank", "pp_size", "max_norm"):
            if not hasattr(plugin, needed):
                raise TypeError(f"HybridParallelTrainer needs a HybridParallelPlugin (or MoeHybridParallelPlugin, "
                                f"LowLevelZeroPlugin); got {type(plugin).__name__}, which has no {needed!r}.")
        self.plugin = plugin
        self.booster = Booster(plugin=plugin)
        self._window = AccumulationWindow()
        self._representatives: Optional[List[int]] = None  # one world rank per replica (gather_function)
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        self._boost()
        self._fused_head: Optional[FusedHeadOnPlugin] = attach(self)  # TRL's trainers (trl_support.py)

    # -- set-up ----------------------------------------------------------------------------------------------
    def _refuse_unsupported(self) -> None:
        """Options acting on the whole model outside the plugin: refused on every rank, before any collective."""
        args, problems = self.args, []
        if args.world_size != dist.get_world_size():
            problems.append(f"TrainingArguments sees {args.world_size} process(es) in a job of "
                            f"{dist.get_world_size()} (accelerate's state): on CPU accelerate counts the processes "
                            f"only with TrainingArguments(use_cpu=True)")
        if self.model_init is not None:
            problems.append("model_init (hyperparameter search): pass the model itself")
        if activation_checkpointing(args):
            problems.append(f"{checkpointing_argument()}=True: use HybridParallelPlugin(gradient_checkpoint_config="
                            f"...)")
        if args.train_sampling_strategy == "batch_rebalance":
            problems.append("train_sampling_strategy='batch_rebalance' (its sampler shards over the world)")
        if args.torch_compile:
            problems.append("torch_compile=True (accelerate would compile the model it wraps; this one is not)")
        if args.fp16 or args.bf16:
            problems.append("fp16/bf16 training arguments: use HybridParallelPlugin(precision='bf16' or 'fp16')")
        if self.plugin.pp_size > 1 and not is_trl_trainer(self) and (  # TRL's: trl_problems
                self.compute_loss_func is not None or self.label_smoother is not None
                or type(self).compute_loss is not Trainer.compute_loss):
            problems.append("compute_loss_func, label_smoothing_factor or a compute_loss override under "
                            "pp_size > 1 (the pipeline uses the model's own loss)")
        if self.plugin.pp_size > 1 and self.plugin.config.pipeline.loss_weight_fn is not None:
            problems.append("HybridParallelPlugin(loss_weight_fn=...): Trainer weighs the loss by its tokens itself "
                            "(num_items_in_batch); drop loss_weight_fn")
        if self.plugin.max_norm > 0 and args.max_grad_norm > 0 and self.plugin.max_norm != args.max_grad_norm:
            problems.append(f"HybridParallelPlugin(max_norm={self.plugin.max_norm}) and TrainingArguments("
                            f"max_grad_norm={args.max_grad_norm}) differ: set one of them")
        problems += trl_problems(self)
        if self.plugin.pp_size > 1 and is_trl(self, "DPOTrainer"):  # what DPO's pipeline step does not run
            problems += dpo_pipeline_problems(self)
        if problems:
            raise ValueError("HybridParallelTrainer does not support: " + "; ".join(problems) + ".")

    def _boost(self) -> None:
        """Trainer's optimizer over the whole model, then both boosted. The boosted optimizer clips with
        `max_grad_norm` (the plugin's `max_norm` if set); with neither it measures the norm without clipping."""
        self._torch_optimizer = self.create_optimizer()
        model, optimizer, *_ = self.booster.boost(self.model, self._torch_optimizer, lr_scheduler=self.lr_scheduler)
        if self.plugin.max_norm <= 0:
            optimizer.max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else math.inf
        self.model_wrapped, self.optimizer, self.model = model, optimizer, model.unwrap()
        for attr in ("model", "optimizer"):
            setattr(self.callback_handler, attr, getattr(self, attr))

    def _prepare_for_training(self, max_steps: int, train_dataloader, resume_from_checkpoint: Optional[str]):
        self._window = AccumulationWindow()  # nothing left over from a run stopped inside a window
        if self._created_lr_scheduler:  # as Trainer: a scheduler it made is remade for this run's step count
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_scheduler(num_training_steps=max_steps, optimizer=self._torch_optimizer)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.model_wrapped, train_dataloader

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        return self.model_wrapped

    def _loss_model(self, model: nn.Module) -> Callable[..., Any]:
        """What compute_loss calls: the boosted model (answering TRL's fused-head calls for TRL's trainers)."""
        return model if self._fused_head is None else self._fused_head

    def get_tp_size(self) -> int:
        """Ranks that hold the same batches (world / dp: tp x pp x sp). Trainer uses it for exactly that: it
        divides its world-gathered loss-item count by it and scales the loss by world / it for data parallel."""
        return self.args.world_size // self.plugin.dp_size

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """The loss items of the window over the replicas (this replica's alone without
        average_tokens_across_devices), whatever the transformers release divided (compat.py)."""
        count = super()._get_num_items_in_batch(batch_samples, device)
        gathered = self.args.average_tokens_across_devices
        if torch.is_tensor(count) and COUNT_DIVIDED_BY_TP_SIZE and not gathered:
            count = count * self.get_tp_size()  # Trainer divided this replica's own count too
        elif torch.is_tensor(count) and not COUNT_DIVIDED_BY_TP_SIZE and gathered:
            count = count / self.get_tp_size()  # the world's count: each replica's items once per rank of it
        return count

    def _unscale_world_loss(self, loss: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        """Trainer's compute_loss before transformers 5.19 scales a token-normalised loss by the world size, not by
        the replicas (world / get_tp_size()): divided back here (compat.py)."""
        scaled = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        if not COUNT_DIVIDED_BY_TP_SIZE and self.args.average_tokens_across_devices and \
                num_items_in_batch is not None and scaled:
            return loss / self.get_tp_size()
        return loss

    # -- data ------------------------------------------------------------------------------------------------
    def _get_dataloader(self, dataset, description: str, batch_size: int, sampler_fn=None, is_training: bool = False,
                        dataloader_key: Optional[str] = None):
        collator = self.data_collator
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(self.data_collator, description=description)
        sampler = None
        if not isinstance(dataset, torch.utils.data.IterableDataset) and sampler_fn is not None:
            sampler = sampler_fn(dataset)
        return replica_dataloader(dataset, dataloader_params(self.args, batch_size, collator), sampler, is_training,
                                  self.args, self.accelerator, Replica(self.plugin.dp_rank, self.plugin.dp_size))

    @property
    def gather_function(self) -> Callable[[Any], Any]:
        """Trainer's gather of evaluation losses, logits and labels: over the replicas (gather.py)."""
        if self.args.eval_use_gather_object:
            raise ValueError("HybridParallelTrainer does not support eval_use_gather_object=True.")
        return self._gather_over_replicas

    @gather_function.setter
    def gather_function(self, value: Callable[[Any], Any]) -> None:
        """Trainer assigns accelerate's gather over processes (at init, after each evaluation): not used."""

    def _gather_over_replicas(self, data: Nested) -> Nested:
        if self._representatives is None:
            self._representatives = replica_representatives(self.plugin.dp_rank)
        return gather_replicas(data, self.accelerator, self._representatives)

    # -- steps -----------------------------------------------------------------------------------------------
    def _dp_loss_scale(self, num_items_in_batch) -> float:
        """As Trainer's compute_loss: a loss normalised by the global item count, times the replicas whose
        gradients the plugin averages."""
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            return float(self.plugin.dp_size)
        return 1.0

    def training_step(self, model: nn.Module, inputs: Dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        window = self.current_gradient_accumulation_steps
        if self.plugin.pp_size > 1:
            batches = self._window.add(inputs, window)
            if batches is None:  # the pipeline runs the whole window at its last batch
                return torch.zeros((), device=self.args.device)
            return self._pipeline_training_step(model, batches, num_items_in_batch)
        last = self._window.add(None, window) is not None
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(self._loss_model(model), inputs, num_items_in_batch=num_items_in_batch)
            loss = self._unscale_world_loss(loss, num_items_in_batch)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # (from transformers 5.19)
        if scaled is None:  # as Trainer.training_step decides
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        if not scaled:
            loss = loss / window
        with contextlib.nullcontext() if last else self.booster.no_sync(model, self.optimizer):
            self.booster.backward(loss, self.optimizer)
        return loss.detach()

    def _pipeline_training_step(self, model: nn.Module, batches: List[MicroBatch],
                                num_items_in_batch) -> torch.Tensor:
        """One pipeline step over the window's batches; their summed loss (what Trainer's per-batch steps add)."""
        model.train()
        if is_trl(self, "DPOTrainer"):  # DPO's loss in the pipeline's criterion (dpo_pipeline.py)
            return dpo_pipeline_loss(self, model, batches).detach().to(self.args.device)
        batch = self._prepare_inputs(concat_batches(batches))
        out = pipeline_loss(self.booster, model, self.optimizer, batch, num_items_in_batch,
                            self._dp_loss_scale(num_items_in_batch))
        return out["loss"].detach().to(self.args.device)

    def _clip_grad_norm(self, model: nn.Module):
        return None  # the boosted optimizer clips in its step (global norm over every shard)

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        return None  # known after the step: see _maybe_log_save_evaluate

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(tr_loss, self.optimizer.get_grad_norm(), *args, **kwargs)

    def prediction_step(self, model: nn.Module, inputs: Dict[str, Any], prediction_loss_only: bool,
                        ignore_keys=None):
        if self.plugin.pp_size == 1:
            loss, logits, labels = super().prediction_step(self._loss_model(model), inputs, prediction_loss_only, ignore_keys)
            if loss is not None and not COUNT_DIVIDED_BY_TP_SIZE:  # counted as Trainer's prediction_step counts
                loss = self._unscale_world_loss(loss, self._get_num_items_in_batch([inputs], self.args.device))
            return loss, logits, labels
        if is_trl(self, "DPOTrainer"):
            raise ValueError("HybridParallelDPOTrainer does not support evaluate() / predict() under pp_size > 1 "
                             "(its pipeline step trains): evaluate with pp_size=1.")
        inputs = self._prepare_inputs(inputs)
        num_items = self._get_num_items_in_batch([inputs], self.args.device)
        with torch.no_grad():
            out = pipeline_loss(self.booster, model, None, inputs, num_items, self._dp_loss_scale(num_items),
                                return_outputs=not prediction_loss_only)
        loss = out["loss"].detach().to(self.args.device)
        if prediction_loss_only:
            return loss, None, None
        logits = logits_on_every_stage(out["outputs"], self.plugin.pp_group, self.args.device)
        labels = inputs.get("labels") if len(self.label_names) == 1 else \
            tuple(inputs.get(name) for name in self.label_names)
        return loss, logits, labels


def _is_hf_dataset(dataset: object) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)
