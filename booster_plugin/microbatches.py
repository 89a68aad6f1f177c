"""How a pipeline step splits and weighs its microbatches: the default number of microbatches, and the
token-weighted loss (`loss_weight_fn`): each microbatch's loss scaled by its share of the global batch's loss items,
and a microbatch without any weighing 0."""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional

import torch
import torch.distributed as dist

from pipeline.schedules import min_microbatches

__all__ = ["default_num_microbatches", "token_weighted_scales", "without_empty_microbatches"]


def default_num_microbatches(batch: Any, pp_size: int, pp_style: str = "1f1b") -> int:
    """Microbatches of a step when none were configured: the largest divisor of the batch size in [pp, 4 * pp]
    (1F1B needs at least pp; more shrinks the bubble (p-1)/(m+p-1), at the cost of smaller microbatches); a
    multiple of pp for the interleaved schedule, at least 2 * pp for dualpipev."""
    multiple_of_pp, least = pp_style == "interleaved", min_microbatches(pp_style, pp_size)
    sizes = [v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0] \
        if isinstance(batch, Mapping) else []
    if not sizes:
        return pp_size  # split_batch explains what is wrong with the batch
    size = sizes[0]
    for m in range(min(size, 4 * pp_size), least - 1, -1):
        if size % m == 0 and not (multiple_of_pp and m % pp_size):
            return m
    raise ValueError(f"A batch of {size} samples cannot be split into {least} to {4 * pp_size} equal microbatches "
                     f"for pp_size={pp_size}, pp_style={pp_style!r}: use a batch size with such a divisor (e.g. "
                     f"{2 * least}) or set num_microbatches / microbatch_size.")


def without_empty_microbatches(criterion: Callable, count: Callable[[Dict[str, Any]], Any]) -> Callable:
    """With a token-weighted loss a microbatch without loss items weighs 0, as in one process on the whole batch:
    its (nan, 0/0) mean loss is replaced by 0, which also gives it zero gradients."""

    def weighted(outputs, micro_batch):
        loss = criterion(outputs, micro_batch)
        return loss if float(count(micro_batch)) > 0 else torch.where(torch.isnan(loss), 0.0, loss)

    return weighted


def token_weighted_scales(count: Callable[[Dict[str, Any]], Any], dp_group: Optional[dist.ProcessGroup],
                          device: torch.device) -> Callable:
    """The schedule's `loss_scales_fn`: weigh each microbatch's (mean) loss by its share of the loss items (e.g. label
    tokens) of the whole global batch, so that the step equals one process on the global batch even with padding.
    `dp_group`: the data-parallel replicas (None: one replica)."""
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1

    def scales(microbatches):
        counts = torch.tensor([float(count(mb)) for mb in microbatches], dtype=torch.float64)
        total = counts.sum().reshape(1).to(device)
        local = float(total.item())
        if dp_size > 1:  # gradients are averaged over replicas: scale by dp / global count
            dist.all_reduce(total, group=dp_group)
        backward = (counts * dp_size / max(float(total.item()), 1.0)).tolist()
        report = (counts / max(local, 1.0)).tolist()  # this replica's token mean
        return backward, report

    return scales
