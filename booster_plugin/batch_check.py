"""Per-step agreement on the batch, so that a bad batch raises the same clear error on every rank of the job.

Each rank describes its batch in a few integers (its shapes, how it splits into microbatches, and the first
token id or label outside the vocabulary) and one all-gather over the world shares the descriptions. Then every
rank decides alike: ranks of one data-parallel replica (its tp ranks and pipeline stages) must hold the same
shapes and split (otherwise P2P and tp collectives would hang or abort), and no rank may hold an id or label that
the model would reject (or that a vocab-parallel layer would silently mask). Without this, an error raised on one
stage only leaves the other stages blocked in a receive.
"""
from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional

import torch
import torch.distributed as dist

__all__ = ["BatchLimits", "agree_on_batch", "vocab_of", "label_vocab_of"]

_SHAPE_SLOTS = 24
OK, BAD_ID, BAD_LABEL, BAD_SPLIT, BAD_LENGTH = 0, 1, 2, 3, 4


class BatchLimits(NamedTuple):
    """What the model accepts: token ids in [0, vocab), labels in [0, label_vocab) or ignore_index (LM heads only),
    sequence lengths that are multiples of `sequence_multiple` (sequence parallelism: the tp size)."""
    vocab: Optional[int]
    label_vocab: Optional[int]
    ignore_index: int = -100
    sequence_multiple: int = 1


def _first_outside(t: Any, bound: Optional[int], ignore: Optional[int] = None) -> Optional[int]:
    if bound is None or not isinstance(t, torch.Tensor) or t.is_floating_point() or t.numel() == 0:
        return None
    bad = (t < 0) | (t >= bound)
    if ignore is not None:
        bad &= t != ignore
    return int(t[bad][0]) if bool(bad.any()) else None


def _describe(batch: Any, limits: BatchLimits, split: Callable[[Any], int]) -> tuple:
    """(code, value, microbatches, shapes) of this rank's batch."""
    try:
        m = split(batch)
    except (TypeError, ValueError) as error:
        return BAD_SPLIT, 0, -1, [], error
    shapes: List[int] = []
    for key in sorted(batch):
        v = batch[key]
        if isinstance(v, torch.Tensor):
            shapes += [v.dim(), *v.shape]
    bad = _first_outside(batch.get("input_ids"), limits.vocab)
    if bad is not None:
        return BAD_ID, bad, m, shapes, None
    tokens = next((batch[k] for k in ("input_ids", "inputs_embeds") if isinstance(batch.get(k), torch.Tensor)), None)
    if tokens is not None and tokens.dim() > 1 and tokens.shape[1] % limits.sequence_multiple:
        return BAD_LENGTH, tokens.shape[1], m, shapes, None
    labels = batch.get("labels")
    ids = batch.get("input_ids")
    if isinstance(labels, torch.Tensor) and isinstance(ids, torch.Tensor) and labels.shape == ids.shape:
        bad = _first_outside(labels, limits.label_vocab, limits.ignore_index)  # token labels of an LM head
        if bad is not None:
            return BAD_LABEL, bad, m, shapes, None
    return OK, 0, m, shapes, None


def agree_on_batch(batch: Any, limits: BatchLimits, split: Callable[[Any], int], dp_rank: int,
                   device: torch.device) -> None:
    """Raise the same error on every rank if any rank's batch is bad; collective over the world.

    Args:
        batch: this rank's batch (a dict of tensors).
        limits: the model's vocabulary bounds.
        split: batch -> number of microbatches (raises on a batch that does not split).
        dp_rank: this rank's data-parallel replica; its ranks must agree on shapes and split.
        device: where the description tensor lives (the backend's device).
    """
    code, value, m, shapes, local_error = _describe(batch, limits, split)
    shapes = (shapes + [-1] * _SHAPE_SLOTS)[:_SHAPE_SLOTS] + [len(shapes)]
    mine = torch.tensor([dp_rank, code, value, m, *shapes], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    rows = [r.tolist() for r in rows]
    if local_error is not None:  # this rank's own reason is the most specific one (after the all-gather: no hang)
        raise local_error
    for rank, (dp, c, v, mb, *_) in enumerate(rows):
        if c == OK:
            continue
        where = f"on rank {rank} (data-parallel replica {dp})"
        if c == BAD_ID:
            raise IndexError(f"Token id {v} {where} is outside the vocabulary [0, {limits.vocab}): check the tokenizer "
                             f"against the model's vocab_size.")
        if c == BAD_LABEL:
            raise IndexError(f"Label {v} {where} is out of bounds: labels must lie in [0, {limits.label_vocab}) or "
                             f"equal ignore_index={limits.ignore_index}.")
        if c == BAD_LENGTH:
            n = limits.sequence_multiple
            raise ValueError(f"Sequence length {v} {where} is not divisible by tp_size={n}: "
                             f"enable_sequence_parallelism splits the sequence over the tp ranks; pad the batches to "
                             f"a multiple of {n} (e.g. the tokenizer's pad_to_multiple_of={n}).")
        raise ValueError(f"The batch {where} cannot be split into microbatches (that rank raised the reason); every "
                         f"replica's batch must split (see num_microbatches / microbatch_size).")
    mine_row = rows[dist.get_rank()]
    for rank, row in enumerate(rows):
        if row[0] == dp_rank and row[3:] != mine_row[3:]:
            raise ValueError(
                f"The ranks of data-parallel replica {dp_rank} got different batches: rank {dist.get_rank()} has "
                f"{_shape_text(mine_row)}, rank {rank} has {_shape_text(row)}. Every tp rank and pipeline stage of a "
                f"replica must get the same batch (use plugin.prepare_dataloader, and the same sequence length and "
                f"microbatch settings on every rank).")


def _shape_text(row: List[int]) -> str:
    m, shapes = row[3], row[4:4 + row[-1]][:_SHAPE_SLOTS]
    out, i = [], 0
    while i < len(shapes):
        n = shapes[i]
        out.append(tuple(shapes[i + 1:i + 1 + n]))
        i += 1 + n
    return f"tensor shapes {out} in {m} microbatches"


def label_vocab_of(model: torch.nn.Module) -> Optional[int]:
    """Size of the LM head's output (token labels are checked against it); None for other heads."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    return getattr(head, "out_features", None) or getattr(head, "num_embeddings", None)


def vocab_of(model: torch.nn.Module) -> Optional[int]:
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embedding, "num_embeddings", None)
