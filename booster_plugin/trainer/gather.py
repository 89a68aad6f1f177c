"""Evaluation results gathered over data-parallel replicas, as accelerate's `gather_for_metrics` gathers them over
processes: every rank of a replica holds the same rows (tp ranks gather their logits in eval mode), so a world
gather would repeat each replica's rows tp x pp x sp times. The rows of one rank per replica are kept, in replica
order (the order accelerate's sharding gave the batches), and the padding rows of an epoch's last batch dropped."""
from __future__ import annotations

from typing import List, TypeVar

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import recursively_apply

from pipeline.groups import world_group

Nested = TypeVar("Nested")  # nested tensors (losses, logits, labels), gathered in the same structure


def replica_representatives(dp_rank: int) -> List[int]:
    """For each dp rank in order, the first world rank of that replica (collective over the world)."""
    ranks: List[int] = [0] * dist.get_world_size()
    dist.all_gather_object(ranks, dp_rank, group=world_group())
    return [ranks.index(d) for d in range(max(ranks) + 1)]


def gather_replicas(data: Nested, accelerator: Accelerator, representatives: List[int]) -> Nested:
    """`accelerator.gather_for_metrics(data)` over replicas instead of processes (collective over the world)."""
    world = dist.get_world_size()
    gathered = accelerator.gather(data)

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        rows = tensor.shape[0] // world  # equal per rank (accelerate's even batches, padded lengths)
        return torch.cat([tensor[r * rows:(r + 1) * rows] for r in representatives])

    kept = recursively_apply(keep, gathered)
    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0:  # accelerate's own truncation of the last batch
        kept = recursively_apply(lambda t: t[:state.remainder], kept)
    return kept
