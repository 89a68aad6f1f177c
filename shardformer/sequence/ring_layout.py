"""Where the tokens are and which of them may attend to which, for ring attention over a sequence-parallel group.

Zigzag layout (causal load balancing): a sequence of length S is cut into 2 * sp chunks of c = S / (2 * sp) tokens;
rank r holds chunks r and 2 * sp - 1 - r, concatenated in that order (local length 2 * c). Under a causal mask every
rank then does the same number of unmasked block products (one early and one late chunk each).

Documents: a packed row holds several documents, marked as transformers marks them (`find_packed_sequence_indices`):
a token starts a new document when its position id is not its predecessor's plus one (e.g. position ids restarting
at 0 with the flattening collator). A query attends to a key iff both are in the same document, the key is not later
(causal) and, with a sliding window w, the key is fewer than w tokens earlier (transformers' `kv_idx > q_idx - w`).

`BlockMasks` answers, for one (query chunk, key chunk) pair, whether the block is skipped (no pair may attend, in any
row), computed without a mask (every pair may attend, in every row), exactly causal (a diagonal block whose row i
attends keys 0..i, in every row: fused kernels take it as is_causal) or masked otherwise, and gives that mask.

The model's own mask: `ModelMask` answers the same questions by reading transformers' 4-D mask of the full sequence
([b or 1, 1, S, S] in natural order: bool, True = attend, as `sdpa_mask` builds it; or additive float, 0 = attend and
-inf / the dtype's minimum = masked, as `eager_mask` builds it). Each block is the slice (query chunk rows, key chunk
columns) of that mask, so whatever transformers decided (documents from position_ids or not, padding, sliding window)
is what the ring computes. Rows without any key: with a bool or -inf mask the output is 0 and no gradient flows (what
torch sdpa returns); with a finite minimum (eager) every key's score is that same minimum, so the softmax is uniform
over the row's keys and gradients flow as through any score: `ModelMask.uniform` marks such rows, whose scores the
kernel sets to 0 (the same softmax and the same gradients).

Heads: the kernel works on the two local chunks with each key/value head's query heads stacked along the rows
(`HeadGroups`, `query_blocks`, ...), so grouped-query attention multiplies against the key/value head itself, and
sends keys and values as one flat buffer (`pack_kv`). Nothing here communicates except `gather_zigzag`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["zigzag_chunks", "zigzag_chunk_size", "shard_zigzag", "unshard_zigzag", "zigzag_index", "gather_zigzag",
           "shard_position_ids", "document_ids", "Documents", "documents", "BlockKind", "BlockMasks", "ModelMask",
           "analyse_mask", "model_mask", "HeadGroups",
           "query_blocks", "query_grad", "output_layout", "output_grad", "pack_kv", "unpack_kv", "kv_grads"]


def zigzag_chunks(world: int, rank: int) -> Tuple[int, int]:
    """The two chunk indices rank `rank` holds, in their local order."""
    return rank, 2 * world - 1 - rank


def zigzag_chunk_size(length: int, world: int) -> int:
    """Tokens per chunk; raises ValueError (no collective) unless `length` is a multiple of 2 * world."""
    if length % (2 * world):
        raise ValueError(f"ring attention cuts the sequence into 2 * sp = {2 * world} zigzag chunks, but the sequence "
                         f"length is {length}: pad the batch to a multiple of {2 * world} (e.g. the tokenizer's "
                         f"pad_to_multiple_of={2 * world}, or pack rows to such a length).")
    return length // (2 * world)


def shard_zigzag(x: Tensor, world: int, rank: int, dim: int = 1) -> Tensor:
    """This rank's part of the full-sequence tensor `x` (sequence along `dim`): chunks r and 2*sp-1-r, concatenated.
    Differentiable (the gradient of the other chunks is zero)."""
    c = zigzag_chunk_size(x.shape[dim], world)
    first, second = zigzag_chunks(world, rank)
    return torch.cat([x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)], dim)


def unshard_zigzag(parts: Sequence[Tensor], dim: int = 1) -> Tensor:
    """The full sequence from every rank's part (`parts[r]` from rank r, as `shard_zigzag` made it)."""
    world = len(parts)
    c = parts[0].shape[dim] // 2
    chunks: List[Optional[Tensor]] = [None] * (2 * world)
    for rank, part in enumerate(parts):
        first, second = zigzag_chunks(world, rank)
        chunks[first], chunks[second] = part.narrow(dim, 0, c), part.narrow(dim, c, c)
    return torch.cat(chunks, dim)


def zigzag_index(length: int, world: int, device: Optional[torch.device] = None) -> Tensor:
    """Token order of the ranks' parts one after another: `x.index_select(dim, zigzag_index(...))` split evenly
    over the group is each rank's `shard_zigzag`, so a contiguous split (`split_to_tp`) and gather
    (`gather_from_tp`) with their autograd become zigzag ones; `argsort()` of it restores the sequence order."""
    c = zigzag_chunk_size(length, world)
    starts = [chunk * c for rank in range(world) for chunk in zigzag_chunks(world, rank)]
    return torch.cat([torch.arange(start, start + c, device=device) for start in starts])


def gather_zigzag(x: Tensor, group: Optional[ProcessGroup], dim: int = 1) -> Tensor:
    """All-gather every rank's zigzag part of `x` over `group` and reassemble the full sequence (not
    differentiable; meant for small tensors such as position ids, and for tests). Collective: every rank calls it."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return unshard_zigzag(parts, dim)


def shard_position_ids(position_ids: Tensor, world: int, rank: int) -> Tensor:
    """This rank's zigzag part of `position_ids` ([S] or [batch, S]: the sequence is the last dimension)."""
    return shard_zigzag(position_ids, world, rank, dim=position_ids.dim() - 1)


def document_ids(position_ids: Tensor) -> Tensor:
    """Document index of every token ([batch, S] int64, nondecreasing along each row, 0 first): a document starts
    where a position id is not its predecessor's plus one (transformers' rule for packed rows)."""
    pos = position_ids.reshape(-1, position_ids.shape[-1]) if position_ids.dim() != 2 else position_ids
    starts = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1
    return starts.long().cumsum(-1)


@dataclass(frozen=True)
class Documents:
    """Document ids of a packed batch and, per row and chunk, the ids of the chunk's first and last tokens (Python
    ints, computed once per batch so that no block decision reads a device tensor).

    Invariant: ids are nondecreasing along each row, so chunk b's keys all precede chunk a's documents iff
    last[row][b] < first[row][a], and both chunks lie inside one document iff first[row][b] == last[row][a]
    (b <= a)."""
    ids: Tensor  # [batch or 1, S] int64
    first: Tuple[Tuple[int, ...], ...]  # [row][chunk]
    last: Tuple[Tuple[int, ...], ...]


def documents(position_ids: Tensor, world: int) -> Optional[Documents]:
    """The documents of full-sequence `position_ids` ([S] or [batch, S]) for 2 * world chunks; None when every row
    is a single document (plain causal attention)."""
    ids = document_ids(position_ids)
    c = zigzag_chunk_size(ids.shape[-1], world)
    if not bool(ids[:, -1].any()):
        return None
    bounds = ids.reshape(ids.shape[0], 2 * world, c)
    first, last = bounds[:, :, 0].tolist(), bounds[:, :, -1].tolist()
    return Documents(ids, tuple(map(tuple, first)), tuple(map(tuple, last)))


class BlockKind(enum.Enum):
    SKIP = 0  # no (query, key) pair of the block may attend, in any row: not computed
    FULL = 1  # every pair may attend, in every row: computed without a mask
    MASKED = 2  # computed with `BlockMasks.masked`
    CAUSAL = 3  # a diagonal block, query i attends key j iff j <= i, in every row (also what `masked` gives)


@dataclass(frozen=True)
class BlockMasks:
    """Block decisions for chunks of `chunk` tokens: causal, optional sliding `window`, optional `docs`."""
    chunk: int
    window: Optional[int] = None
    docs: Optional[Documents] = None

    def kind(self, q_chunk: int, k_chunk: int) -> BlockKind:
        """Which of the three the (query chunk, key chunk) block is; deterministic, so forward and backward (and
        every rank) agree."""
        if k_chunk > q_chunk:
            return BlockKind.SKIP
        c, gap = self.chunk, q_chunk - k_chunk
        if self.window is not None and gap * c - (c - 1) >= self.window:  # even the closest pair is too far apart
            return BlockKind.SKIP
        if self.docs is not None and all(last[k_chunk] < first[q_chunk]
                                         for first, last in zip(self.docs.first, self.docs.last)):
            return BlockKind.SKIP
        if gap == 0:
            one_document = self.docs is None or all(first[q_chunk] == last[q_chunk]
                                                    for first, last in zip(self.docs.first, self.docs.last))
            return BlockKind.CAUSAL if one_document and (self.window is None or self.window >= c) else \
                BlockKind.MASKED
        if self.window is not None and gap * c + (c - 1) >= self.window:
            return BlockKind.MASKED
        if self.docs is not None and any(first[k_chunk] != last[q_chunk]
                                         for first, last in zip(self.docs.first, self.docs.last)):
            return BlockKind.MASKED
        return BlockKind.FULL

    def masked(self, q_chunk: int, k_chunk: int, device: torch.device) -> Tensor:
        """True where the query (row) may NOT attend to the key (column): [batch or 1, 1, c, c] bool, to broadcast
        over the key/value heads."""
        c = self.chunk
        q = torch.arange(q_chunk * c, (q_chunk + 1) * c, device=device)[:, None]
        k = torch.arange(k_chunk * c, (k_chunk + 1) * c, device=device)[None, :]
        masked = k > q
        if self.window is not None:
            masked = masked | (k <= q - self.window)
        masked = masked[None]
        if self.docs is not None:
            ids = self.docs.ids.to(device)
            q_doc = ids[:, q_chunk * c:(q_chunk + 1) * c]
            k_doc = ids[:, k_chunk * c:(k_chunk + 1) * c]
            masked = masked | (q_doc[:, :, None] != k_doc[:, None, :])
        return masked[:, None]

    def uniform(self, q_chunk: int, device: torch.device) -> None:
        """No row of a causal / document / window mask is without keys (a query always sees itself)."""
        return None


Kinds = Tuple[Tuple[BlockKind, ...], ...]  # [query chunk][key chunk]


@dataclass(frozen=True)
class ModelMask:
    """Block decisions read off the model's own mask of the full sequence (see the module docstring). Same interface
    as `BlockMasks`. `rows` and `kinds` come from `analyse_mask` (once per mask; they hold no reference to it)."""
    chunk: int
    mask: Tensor  # the model's [b or 1, 1, S, S] mask: bool (True = attend) or additive float
    rows: Optional[Tensor]  # [b or 1, 1, S, 1] bool, True = uniform row; None when there is none
    kinds: Kinds

    def kind(self, q_chunk: int, k_chunk: int) -> BlockKind:
        return self.kinds[q_chunk][k_chunk]

    def masked(self, q_chunk: int, k_chunk: int, device: torch.device) -> Tensor:
        """True where the query (row) may NOT attend to the key (column): [b or 1, 1, c, c] bool (a uniform row
        spreads over its finite entries)."""
        c = self.chunk
        block = self.mask[:, :, q_chunk * c:(q_chunk + 1) * c, k_chunk * c:(k_chunk + 1) * c].to(device)
        if block.dtype == torch.bool:
            return ~block
        masked = block <= torch.finfo(block.dtype).min / 2
        rows = self.uniform(q_chunk, device)
        return masked if rows is None else torch.where(rows, ~torch.isfinite(block), masked)

    def uniform(self, q_chunk: int, device: torch.device) -> Optional[Tensor]:
        """True for the query chunk's uniform rows ([b or 1, 1, c, 1] bool), or None."""
        c = self.chunk
        return None if self.rows is None else self.rows[:, :, q_chunk * c:(q_chunk + 1) * c].to(device)


def _additive(mask: Tensor, uniform: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """(allowed, uniform rows or None) of an additive float mask: 0 attends; -inf or at most half the dtype's
    minimum is masked; anything else is a bias, refused. A row whose keys are all masked but some by a finite value
    is uniform over those keys (eager adds the minimum to every score: all equal, so the softmax is uniform), unless
    `uniform` is False (attention sinks take the whole softmax then: the row gives 0, as a masked row)."""
    masked = mask <= torch.finfo(mask.dtype).min / 2
    if bool(((mask != 0) & ~masked).any()):
        raise NotImplementedError("ring attention takes the model's attention mask as a mask: its float mask holds "
                                  "values other than 0 (attend) and -inf / the dtype's minimum (masked), i.e. an "
                                  "additive bias (ALiBi, a relative position bias), which it does not compute.")
    allowed = ~masked
    if not uniform:
        return allowed, None
    finite = torch.isfinite(mask)
    rows = masked.all(-1, keepdim=True) & finite.any(-1, keepdim=True)
    if not bool(rows.any()):
        return allowed, None
    return torch.where(rows, finite, allowed), rows


def analyse_mask(mask: Tensor, world: int, uniform: bool = True) -> Tuple[Optional[Tensor], Kinds]:
    """(uniform rows or None, block kinds) of transformers' 4-D mask `mask` ([b or 1, 1, S, S], bool or additive
    float) for 2 * world chunks: one pass over the mask and one device-to-host copy. `uniform=False`: no uniform
    rows (attention sinks)."""
    n, c = 2 * world, zigzag_chunk_size(mask.shape[-1], world)
    allowed, rows = (mask, None) if mask.dtype == torch.bool else _additive(mask, uniform)
    blocks = allowed.reshape(allowed.shape[0], n, c, n, c)
    special = torch.zeros(n, dtype=torch.bool, device=mask.device) if rows is None else \
        rows.reshape(-1, n, c).any(dim=(0, 2))
    tril = torch.ones(c, c, dtype=torch.bool, device=mask.device).tril()
    causal = (torch.diagonal(blocks, dim1=1, dim2=3) == tril[:, :, None]).all(dim=(0, 1, 2)) & ~special
    some, every, special, causal = torch.stack([blocks.any(dim=(0, 2, 4)), blocks.all(dim=(0, 2, 4)),
                                                special[:, None].expand(n, n), causal.diag()]).tolist()
    kinds = tuple(tuple(BlockKind.SKIP if not some[q][k] else
                        BlockKind.FULL if every[q][k] and not special[q][k] else
                        BlockKind.CAUSAL if causal[q][k] else BlockKind.MASKED
                        for k in range(n)) for q in range(n))
    return rows, kinds


def model_mask(mask: Tensor, world: int, uniform: bool = True) -> ModelMask:
    """The `ModelMask` of `mask` for 2 * world chunks (see `analyse_mask`)."""
    return ModelMask(zigzag_chunk_size(mask.shape[-1], world), mask, *analyse_mask(mask, world, uniform))


# -- heads: transformers' [b, h, 2c, d] <-> the two local chunks with the query heads grouped by key/value head ------
class HeadGroups(NamedTuple):
    """Shapes of the grouped layout: batch, kv heads, query heads per kv head, chunk length, key and value dims."""
    b: int
    hkv: int
    g: int
    c: int
    dk: int
    dv: int


def query_blocks(query: Tensor, n: HeadGroups) -> Tensor:
    """[b, h, 2c, d] -> [2, b, hkv, g*c, d] (query head h = kv_head * g + j, as transformers' repeat_kv)."""
    q = query.reshape(n.b, n.hkv, n.g, 2, n.c, n.dk).permute(3, 0, 1, 2, 4, 5)
    return q.reshape(2, n.b, n.hkv, n.g * n.c, n.dk)


def query_grad(dq: Tensor, n: HeadGroups) -> Tensor:
    """Inverse of `query_blocks`: [2, b, hkv, g*c, d] -> [b, h, 2c, d]."""
    return dq.view(2, n.b, n.hkv, n.g, n.c, n.dk).permute(1, 2, 3, 0, 4, 5).reshape(n.b, n.hkv * n.g, 2 * n.c, n.dk)


def output_layout(out: Tensor, n: HeadGroups) -> Tensor:
    """[2, b, hkv, g*c, dv] -> [b, 2c, h, dv] (transformers' attention output layout)."""
    return out.view(2, n.b, n.hkv, n.g, n.c, n.dv).permute(1, 0, 4, 2, 3, 5).reshape(n.b, 2 * n.c, -1, n.dv)


def output_grad(grad: Tensor, n: HeadGroups) -> Tensor:
    """Inverse of `output_layout`."""
    grad = grad.reshape(n.b, 2, n.c, n.hkv, n.g, n.dv).permute(1, 0, 3, 4, 2, 5)
    return grad.reshape(2, n.b, n.hkv, n.g * n.c, n.dv)


def pack_kv(key: Tensor, value: Tensor, n: HeadGroups) -> Tensor:
    """One flat buffer (a single message per ring step): keys [2, b, hkv, c, dk] then values [2, b, hkv, c, dv]."""
    k = key.reshape(n.b, n.hkv, 2, n.c, n.dk).permute(2, 0, 1, 3, 4)
    v = value.reshape(n.b, n.hkv, 2, n.c, n.dv).permute(2, 0, 1, 3, 4)
    return torch.cat([k.reshape(-1), v.reshape(-1).to(k.dtype)])


def unpack_kv(flat: Tensor, n: HeadGroups) -> Tuple[Tensor, Tensor]:
    """Views of a `pack_kv` buffer (or of its gradient)."""
    nk = 2 * n.b * n.hkv * n.c * n.dk
    return flat[:nk].view(2, n.b, n.hkv, n.c, n.dk), flat[nk:].view(2, n.b, n.hkv, n.c, n.dv)


def kv_grads(flat: Tensor, n: HeadGroups, k_shape, k_dtype, v_shape, v_dtype) -> Tuple[Tensor, Tensor]:
    """Inverse of `pack_kv`: gradients in the layout and dtypes of the key and value."""
    dk, dv = unpack_kv(flat, n)
    return (dk.permute(1, 2, 0, 3, 4).reshape(k_shape).to(k_dtype),
            dv.permute(1, 2, 0, 3, 4).reshape(v_shape).to(v_dtype))
