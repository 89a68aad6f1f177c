"""The vocab-parallel lookup, in two halves around any embedding lookup: ids this rank does not own are looked up
as row 0 and their rows zeroed before the partial results are summed over the tp group.

`VocabParallelEmbedding` uses it around `F.embedding`; `shard_embedding_in_place` around the forward of an
nn.Embedding subclass (e.g. one that scales its output), which keeps its class, buffers and parameter names."""
from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from pipeline.context import Axis

from .comm import reduce_from_tp
from .spec import TPSpec, padded_size, shard_parameter

__all__ = ["LocalIds", "local_ids", "combine_lookup", "shard_embedding_in_place"]


class LocalIds(NamedTuple):
    ids: Tensor      # ids relative to this rank's first row; 0 where another rank owns the id
    outside: Tensor  # True where another rank owns the id


def local_ids(ids: Tensor, vocab_start: int, vocab_end: int) -> LocalIds:
    outside = (ids < vocab_start) | (ids >= vocab_end)
    return LocalIds((ids - vocab_start).masked_fill(outside, 0), outside)


def combine_lookup(out: Tensor, outside: Tensor, group: ProcessGroup | None) -> Tensor:
    """Zero the rows another rank owns and sum the partial lookups over the group."""
    return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0.0), group)


def shard_embedding_in_place(module: nn.Embedding, tp: Axis, make_vocab_size_divisible_by: int) -> None:
    """Split an embedding's rows over the group without replacing the module: its own forward (e.g. a scaled lookup,
    elementwise in the looked-up rows) runs on local ids, and hooks zero foreign rows and sum the results."""
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise NotImplementedError(f"{type(module).__name__}: max_norm, scale_grad_by_freq and sparse are not supported")
    world, rank, group = tp.size, tp.rank, tp.group
    padded = padded_size(module.num_embeddings, world, make_vocab_size_divisible_by)
    per_rank = padded // world
    start, end = rank * per_rank, (rank + 1) * per_rank
    spec = TPSpec(0, full_size=module.num_embeddings, padded=padded, group=group)
    module.weight = shard_parameter(module.weight, spec, rank, world)
    pad = module.padding_idx
    module.padding_idx = pad - start if pad is not None and start <= pad < end else None
    pending = []

    def before(mod, args):
        split = local_ids(args[0], start, end)
        pending.append(split.outside)
        return (split.ids, *args[1:])

    def after(mod, args, out):
        return combine_lookup(out, pending.pop(), group)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)
