"""How a pipeline step splits and weighs its microbatches: the batch split along dim 0 (into a configured number,
of a configured size, or by default the number the schedule style suits best for the batch size), and the
token-weighted loss (`loss_weight_fn`): each microbatch's loss scaled by its share of the global batch's loss items,
and a microbatch without any weighing 0."""
from __future__ import annotations

from typing import Callable, List, Mapping, NamedTuple, Optional, SupportsFloat

import torch
import torch.distributed as dist

from pipeline.step import LossWeights, MicroBatch
from pipeline.styles import ScheduleStyle
from shardformer.multimodal_batch import RaggedRows, take_samples

__all__ = ["MicrobatchSplit", "default_num_microbatches", "split_batch", "token_weighted_scales",
           "without_empty_microbatches"]


def split_batch(batch: object, num_microbatches: Optional[int], microbatch_size: Optional[int],
                ragged: Optional[RaggedRows] = None) -> List[MicroBatch]:
    """Split every tensor of a batch dict along dim 0; non-tensor values are given to every microbatch. `ragged`:
    the model's inputs whose dim 0 counts images or patches (shardformer/multimodal_batch.py), split with the
    samples they belong to."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"A pipeline batch must be a dict of tensors (e.g. input_ids, attention_mask, labels), "
                        f"got {type(batch).__name__}.")
    special = ragged(batch) if ragged is not None else {}
    sizes = {k: v.shape[0] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0
             and k not in special}
    if not sizes:
        raise ValueError("The batch has no tensor to split into microbatches.")
    batch_size = next(iter(sizes.values()))
    if any(s != batch_size for s in sizes.values()):
        raise ValueError(f"All tensors of a batch must share dim 0 (the batch size); got {sizes}.")
    if num_microbatches is not None and microbatch_size is not None:  # both (as ColossalAI): they must agree
        if batch_size != num_microbatches * microbatch_size:
            raise ValueError(f"Batch size {batch_size} != num_microbatches={num_microbatches} * microbatch_size="
                             f"{microbatch_size}: give batches of {num_microbatches * microbatch_size} samples, or "
                             f"set only one of num_microbatches and microbatch_size.")
    elif num_microbatches is None:
        if batch_size % microbatch_size:
            raise ValueError(f"Batch size {batch_size} is not divisible by microbatch_size={microbatch_size}.")
        num_microbatches = batch_size // microbatch_size
    if batch_size % num_microbatches:
        raise ValueError(f"Batch size {batch_size} is not divisible into num_microbatches={num_microbatches}; "
                         f"use a batch size that is a multiple of {num_microbatches}.")
    size = batch_size // num_microbatches
    return [take_samples(batch, i * size, (i + 1) * size, ragged) for i in range(num_microbatches)]


def default_num_microbatches(batch: object, pp_size: int, style: ScheduleStyle, ragged: Optional[RaggedRows] = None
                             ) -> int:
    """Microbatches of a step when none were configured: the largest divisor of the batch size in [pp, 4 * pp]
    (1F1B needs at least pp; more shrinks the bubble (p-1)/(m+p-1), at the cost of smaller microbatches); a
    multiple of pp for the interleaved schedule, at least 2 * pp for dualpipev."""
    least = style.min_microbatches(pp_size)
    special = ragged(batch) if ragged is not None and isinstance(batch, Mapping) else {}
    sizes = [v.shape[0] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0
             and k not in special] if isinstance(batch, Mapping) else []
    if not sizes:
        return pp_size  # split_batch explains what is wrong with the batch
    size = sizes[0]
    for m in range(min(size, 4 * pp_size), least - 1, -1):
        if size % m == 0 and not (style.microbatches_multiple_of_ranks and m % pp_size):
            return m
    raise ValueError(f"A batch of {size} samples cannot be split into {least} to {4 * pp_size} equal microbatches "
                     f"for pp_size={pp_size}, pp_style={style.name!r}: use a batch size with such a divisor (e.g. "
                     f"{2 * least}) or set num_microbatches / microbatch_size.")


class MicrobatchSplit(NamedTuple):
    """The plugin's microbatch setting: `num_microbatches`, or `microbatch_size` samples each (both: every batch
    must hold their product), or (neither) each batch's `default_num_microbatches` for `style` on `pp_size` pipeline ranks."""
    num_microbatches: Optional[int]
    microbatch_size: Optional[int]
    style: ScheduleStyle
    pp_size: int

    def split(self, batch: object, ragged: Optional[RaggedRows] = None) -> List[MicroBatch]:
        """The microbatches of `batch` (raises TypeError or ValueError on a batch that does not split); `ragged`:
        as split_batch's."""
        count = self.num_microbatches
        if count is None and self.microbatch_size is None:
            count = default_num_microbatches(batch, self.pp_size, self.style, ragged)
        return split_batch(batch, count, self.microbatch_size, ragged)


def without_empty_microbatches(criterion: Callable, count: Callable[[MicroBatch], SupportsFloat]) -> Callable:
    """With a token-weighted loss a microbatch without loss items weighs 0, as in one process on the whole batch:
    its (nan, 0/0) mean loss is replaced by 0, which also gives it zero gradients."""

    def weighted(outputs, micro_batch):
        loss = criterion(outputs, micro_batch)
        return loss if float(count(micro_batch)) > 0 else torch.where(torch.isnan(loss), 0.0, loss)

    return weighted


def token_weighted_scales(count: Callable[[MicroBatch], SupportsFloat], dp_group: Optional[dist.ProcessGroup],
                          device: torch.device) -> Callable[[List[MicroBatch]], LossWeights]:
    """The step's loss weights: weigh each microbatch's (mean) loss by its share of the loss items (e.g. label
    tokens) of the whole global batch, so that the step equals one process on the global batch even with padding.
    `dp_group`: the data-parallel replicas (None: one replica); collective over it."""
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1

    def scales(microbatches: List[MicroBatch]) -> LossWeights:
        counts = torch.tensor([float(count(mb)) for mb in microbatches], dtype=torch.float64)
        total = counts.sum().reshape(1).to(device)
        local = float(total.item())
        if dp_size > 1:  # gradients are averaged over replicas: scale by dp / global count
            dist.all_reduce(total, group=dp_group)
        backward = (counts * dp_size / max(float(total.item()), 1.0)).tolist()
        report = (counts / max(local, 1.0)).tolist()  # this replica's token mean
        return LossWeights(backward, report)

    return scales
