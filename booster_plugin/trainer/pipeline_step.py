"""Trainer steps under pipeline parallelism. Trainer calls `training_step` once per batch of an accumulation window;
a pipeline needs the window's batches at once (one step over their concatenation, which the plugin splits into its
microbatches). `AccumulationWindow` keeps the batches until the window is complete; the last call runs
`execute_pipeline`.

Loss: the model computes its own loss with `num_items_in_batch` (the window's loss items over every replica, as
Trainer counts them), so each microbatch's loss is its share of the token-weighted window loss. The pipeline averages
its microbatch losses (ColossalAI's definition) and the plugin averages gradients over data parallel: the criterion
multiplies by the number of microbatches and by `dp_scale`, giving one process's sum over the window, whatever the
split."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from pipeline.step import MicroBatch

from ..plugins.base import PipelineResult

Batch = MicroBatch


def _rows(batch: Batch) -> int:
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ValueError("A Trainer batch for the pipeline must hold tensors (input_ids, labels, ...).")


def concat_batches(batches: List[Batch]) -> Batch:
    """The window's batches as one batch (rows concatenated). They must share keys and shapes past dim 0."""
    first = batches[0]
    for i, batch in enumerate(batches[1:], 1):
        if batch.keys() != first.keys():
            raise ValueError(f"HybridParallelTrainer under pipeline parallelism: batch {i} of the accumulation "
                             f"window has keys {sorted(batch)}, batch 0 {sorted(first)}.")
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.shape[1:] != first[key].shape[1:]:
                raise ValueError(
                    f"HybridParallelTrainer under pipeline parallelism: the batches of one accumulation window "
                    f"become one pipeline step and must have equal shapes past the batch dimension; {key!r} is "
                    f"{tuple(first[key].shape)} in batch 0 and {tuple(value.shape)} in batch {i}. Pad every batch "
                    f"to one length (e.g. tokenizer padding='max_length', or a collator with a fixed length).")
    return {key: torch.cat([b[key] for b in batches]) if isinstance(value, torch.Tensor) and value.dim() > 0
            else value for key, value in first.items()}


def scaled_model_loss(total_rows: int, dp_scale: float) -> Callable[[Any, Batch], torch.Tensor]:
    """The criterion: the model's own loss times the number of (equal) microbatches and `dp_scale`, so that the
    pipeline's mean over microbatches is the sum of the model's losses."""

    def criterion(outputs: Any, micro_batch: Batch) -> torch.Tensor:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        return loss * (total_rows / _rows(micro_batch)) * dp_scale

    return criterion


def pipeline_loss(booster, model, optimizer, batch: Batch, num_items_in_batch: Optional[torch.Tensor],
                  dp_scale: float, return_outputs: bool = False) -> PipelineResult:
    """One pipeline step over `batch`: {"loss", "outputs"} (loss on every rank); trains when `optimizer` is given."""
    if num_items_in_batch is None:
        raise ValueError("HybridParallelTrainer under pipeline parallelism needs the model to compute its loss from "
                         "`labels` with `num_items_in_batch` (a transformers model whose forward takes loss kwargs, "
                         "with `labels` in every batch); this model or batch does not.")
    batch = {**batch, "num_items_in_batch": num_items_in_batch}
    criterion = scaled_model_loss(_rows(batch), dp_scale)
    return booster.execute_pipeline(iter([batch]), model, criterion, optimizer, return_loss=True,
                                    return_outputs=return_outputs)


@dataclass
class AccumulationWindow:
    """Where Trainer is in its accumulation window (it calls training_step once per batch), and the batches kept."""
    batches: List[Batch] = field(default_factory=list)
    seen: int = 0

    def add(self, batch: Optional[Batch], window_size: int) -> Optional[List[Batch]]:
        """Count a batch (kept unless None); at the window's last batch its kept batches (then it starts over),
        before it None."""
        self.seen += 1
        if batch is not None:
            self.batches.append(batch)
        if self.seen < window_size:
            return None
        batches, self.batches, self.seen = self.batches, [], 0
        return batches

def logits_on_every_stage(outputs: Optional[Dict[str, Any]], pp_group, device: torch.device) -> torch.Tensor:
    """The step's full logits, which the rank holding the last stage has, on every pipeline rank (collective over
    the pp group: the holder's shape, then the logits, broadcast)."""
    logits = None if outputs is None else outputs.get("logits")
    if outputs is not None and logits is None:
        raise ValueError("HybridParallelTrainer under pipeline parallelism: the model returned no `logits` for "
                         "compute_metrics / predict().")
    shapes: List[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(shapes, None if logits is None else (tuple(logits.shape), logits.dtype), group=pp_group)
    holder = next(i for i, shape in enumerate(shapes) if shape is not None)
    if logits is None:
        logits = torch.empty(shapes[holder][0], dtype=shapes[holder][1], device=device)
    dist.broadcast(logits, group=pp_group, group_src=holder)
    return logits
