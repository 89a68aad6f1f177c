"""Packing documents into training rows for long-context training: each row is filled with whole documents, marked
the way transformers' flattening collator marks them (`position_ids` restarting at 0 at each document, no attention
mask), so that the model's own forward keeps attention inside each document (with `use_cache=False`, as transformers
requires to detect packed rows) and every sequence-parallel mode stays exact."""
from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Sequence

import torch

__all__ = ["pack_documents"]

IGNORE = -100  # transformers' ignored label


def pack_documents(documents: Iterable[Sequence[int]], row_length: int, pad_token_id: int = 0,
                   rows_per_batch: int = 1) -> Iterator[Dict[str, torch.Tensor]]:
    """Batches of `rows_per_batch` rows of `row_length` tokens: `input_ids`, `position_ids` (restarting at 0 at each
    document) and `labels` (the ids, with each document's first token masked: its prediction would read the previous
    document; the causal LM loss shifts labels itself). Documents are placed whole and in order, a row taking
    documents until the next one does not fit; a document longer than a row is cut into row-sized documents; a row's
    free tail is one padding document of `pad_token_id` with labels masked. A last incomplete batch is dropped."""
    if row_length < 2:
        raise ValueError(f"row_length={row_length}: a row needs at least 2 tokens.")
    batch: List[Dict[str, torch.Tensor]] = []
    for row in _rows(documents, row_length):
        batch.append(_row_tensors(row, row_length, pad_token_id))
        if len(batch) == rows_per_batch:
            yield {k: torch.stack([r[k] for r in batch]) for k in batch[0]}
            batch = []


def _rows(documents: Iterable[Sequence[int]], row_length: int) -> Iterator[List[List[int]]]:
    row: List[List[int]] = []
    used = 0
    for doc in documents:
        pieces = [list(doc[i:i + row_length]) for i in range(0, len(doc), row_length)] or []
        for piece in pieces:
            if used + len(piece) > row_length:
                yield row
                row, used = [], 0
            row.append(piece)
            used += len(piece)
    if row:
        yield row


def _row_tensors(row: List[List[int]], row_length: int, pad_token_id: int) -> Dict[str, torch.Tensor]:
    ids, positions, labels = [], [], []
    for doc in row:
        ids += doc
        positions += list(range(len(doc)))
        labels += [IGNORE] + doc[1:]
    free = row_length - len(ids)
    ids += [pad_token_id] * free
    positions += list(range(free))
    labels += [IGNORE] * free
    return {"input_ids": torch.tensor(ids), "position_ids": torch.tensor(positions), "labels": torch.tensor(labels)}
