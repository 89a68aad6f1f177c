"""Per-step agreement on the batch, so that a bad batch raises the same clear error on every rank of the job.

Each rank describes its batch in a few integers (its shapes, how it splits into microbatches, the first token id or
label outside the vocabulary, an attention mask that does not match its ids, and a digest of each tensor's contents)
and one all-gather shares the descriptions. Then every rank decides alike: ranks of one data-parallel replica (its tp
ranks and pipeline stages) must hold the same shapes, split and contents (otherwise P2P and tp collectives would hang
or abort, or the ranks would silently train on different data), and no rank may hold an id or label that the model
would reject (or that a vocab-parallel layer would silently mask). Without this, an error raised on one stage only
leaves the other stages blocked in a receive.

`agree_on_batch` runs over the world at each `execute_pipeline` step; `DirectCallCheck` runs it over the tp group
when the script calls a tp-sharded model itself (pp = 1).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from pipeline.groups import world_group

from .failure import FailureGuard

__all__ = ["BatchLimits", "DirectCallCheck", "agree_on_batch", "batch_agreed", "vocab_of", "label_vocab_of"]

OK, BAD_ID, BAD_LABEL, BAD_SPLIT, BAD_LENGTH, BAD_MASK = 0, 1, 2, 3, 4, 5
# one row per rank: [dp rank, code, details, microbatches, shapes, number of shape entries, digests]
_DETAIL_SLOTS, _SHAPE_SLOTS, _DIGEST_SLOTS = 6, 24, 8
_SPLIT = 2 + _DETAIL_SLOTS
_DIGESTS = _SPLIT + 2 + _SHAPE_SLOTS
_PRIME = 2 ** 31 - 1        # digest arithmetic: residues < 2**31, products < 2**62, sums of < 2**32 terms < 2**63
_MULTIPLIER = 48271         # position weights ((i + 1) * 48271) % _PRIME: distinct and nonzero for i < _PRIME
_DIGEST_ELEMENTS = 2 ** 20   # at most this many elements of a tensor enter its digest
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# 2-D masks and the tokens whose (batch, sequence) they must match
_MASKED = (("attention_mask", ("input_ids", "inputs_embeds")),
           ("decoder_attention_mask", ("decoder_input_ids", "decoder_inputs_embeds")))
_SHARD_OVER_DP = ("Every tp rank and pipeline stage of a data-parallel replica must get the same batch: shard the "
                  "data over dp only (plugin.prepare_dataloader, or DistributedSampler(num_replicas=dp_size, "
                  "rank=dp_rank) with the plugin's dp_size and dp_rank), not over the whole world, with the same "
                  "sequence length and microbatch settings on every rank")
# the same for a call of the model the script makes itself (evaluation, each forward of `generate`)
SAME_DIRECT_CALL = ("Every tp rank and pipeline stage of a data-parallel replica must call the model with the same "
                    "inputs; to sample (generate(do_sample=True)), seed the global RNG alike on those ranks "
                    "(torch.manual_seed(seed) on every rank) so that they draw the same tokens")
_AGREED = contextvars.ContextVar("batch_agreed", default=False)


class BatchLimits(NamedTuple):
    """What the model accepts: token ids in [0, vocab), labels in [0, label_vocab) or ignore_index (LM heads only),
    sequence lengths that are multiples of `sequence_multiple` (sequence parallelism: the ranks the sequence is split
    over, as `sequence_split` words it)."""
    vocab: Optional[int]
    label_vocab: Optional[int]
    ignore_index: int = -100
    sequence_multiple: int = 1
    sequence_split: str = ""
    ragged: Optional[Callable] = None  # inputs indexing images, not samples (shardformer/multimodal_batch.py)


class _Description(NamedTuple):
    code: int
    details: List[int]
    microbatches: int
    shapes: List[int]
    digests: List[int]
    error: Optional[Exception] = None  # this rank's own reason for BAD_SPLIT


def _first_outside(t: object, bound: Optional[int], ignore: Optional[int] = None) -> Optional[int]:
    if bound is None or not isinstance(t, torch.Tensor) or t.is_floating_point() or t.numel() == 0:
        return None
    bad = (t < 0) | (t >= bound)
    if ignore is not None:
        bad &= t != ignore
    return int(t[bad][0]) if bool(bad.any()) else None


def _digest(t: torch.Tensor) -> int:
    """A position-weighted sum of the tensor's bits modulo a prime, exact in int64 (so equal on every rank that holds
    equal tensors): a changed element, or equal rows or tokens in another order, change it (but for a chance of about
    one in 2**31). One pass over the elements (about 10 ns each on a CPU core); a tensor of more than
    _DIGEST_ELEMENTS (images, embeddings) is digested at _DIGEST_ELEMENTS evenly strided positions."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0
    flat = flat[::-(-flat.numel() // _DIGEST_ELEMENTS)].contiguous()
    bits = flat.view(_INT_OF_SIZE.get(flat.element_size(), torch.uint8)).to(torch.int64).remainder(_PRIME)
    weights = (torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device) * _MULTIPLIER) % _PRIME
    return int((bits * weights).remainder_(_PRIME).sum())


def _mask_mismatch(batch: Mapping[str, object]) -> Optional[List[int]]:
    """[pair, token key, *mask shape, *tokens' (batch, sequence)] of the first 2-D mask that does not match its
    tokens; None if all match (or the batch carries a cache, which the mask also covers)."""
    if batch.get("past_key_values") is not None:
        return None
    for pair, (mask_key, token_keys) in enumerate(_MASKED):
        mask = batch.get(mask_key)
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            continue
        for which, key in enumerate(token_keys):
            tokens = batch.get(key)
            if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 and mask.shape != tokens.shape[:2]:
                return [pair, which, *mask.shape, *tokens.shape[:2]]
    return None


def _tensors(batch: Dict[str, Any]) -> Iterator[Tuple[str, torch.Tensor]]:
    return ((k, batch[k]) for k in sorted(batch) if isinstance(batch[k], torch.Tensor))


def _problem(batch: Dict[str, Any], limits: BatchLimits) -> Tuple[int, List[int]]:
    """(code, details) of the first thing wrong with this rank's batch; (OK, []) if nothing is."""
    bad = _first_outside(batch.get("input_ids"), limits.vocab)
    if bad is not None:
        return BAD_ID, [bad]
    tokens = next((batch[k] for k in ("input_ids", "inputs_embeds") if isinstance(batch.get(k), torch.Tensor)), None)
    if tokens is not None and tokens.dim() > 1 and tokens.shape[1] % limits.sequence_multiple:
        return BAD_LENGTH, [tokens.shape[1]]
    mismatch = _mask_mismatch(batch)
    if mismatch is not None:
        return BAD_MASK, mismatch
    labels = batch.get("labels")
    ids = batch.get("input_ids")
    if isinstance(labels, torch.Tensor) and isinstance(ids, torch.Tensor) and labels.shape == ids.shape:
        bad = _first_outside(labels, limits.label_vocab, limits.ignore_index)  # token labels of an LM head
        if bad is not None:
            return BAD_LABEL, [bad]
    return OK, []


def _describe(batch: Any, limits: BatchLimits, split: Callable[[Any], int]) -> _Description:
    """This rank's batch in integers."""
    try:
        m = split(batch)
    except (TypeError, ValueError) as error:
        return _Description(BAD_SPLIT, [], -1, [], [0] * _DIGEST_SLOTS, error)
    shapes: List[int] = []
    digests = [0] * _DIGEST_SLOTS
    for i, (_, v) in enumerate(_tensors(batch)):
        shapes += [v.dim(), *v.shape]
        slot = min(i, _DIGEST_SLOTS - 1)  # the tensors after the first 7 (in key order) share the last slot
        digests[slot] = (digests[slot] + _digest(v)) % _PRIME ** 2
    return _Description(*_problem(batch, limits), m, shapes, digests)


def _padded(values: List[int], slots: int) -> List[int]:
    return (values + [-1] * slots)[:slots]


def agree_on_batch(batch: Any, limits: BatchLimits, split: Callable[[Any], int], dp_rank: int,
                   device: torch.device, group: Optional[dist.ProcessGroup] = None,
                   fix: str = _SHARD_OVER_DP) -> None:
    """Raise the same error on every rank of `group` if any rank's batch is bad; collective over `group`.

    Args:
        batch: this rank's batch (a dict of tensors).
        limits: the model's vocabulary bounds.
        split: batch -> number of microbatches (raises on a batch that does not split).
        dp_rank: this rank's data-parallel replica; its ranks must agree on shapes, split and contents.
        device: where the description tensor lives (the backend's device).
        group: the ranks that agree (default: the world).
        fix: what ranks of one replica given different batches must do (the error's advice).
    """
    d = _describe(batch, limits, split)
    row = [dp_rank, d.code, *_padded(d.details, _DETAIL_SLOTS), d.microbatches, *_padded(d.shapes, _SHAPE_SLOTS),
           len(d.shapes), *d.digests]
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    group = group if group is not None else world_group()
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(rows, mine, group=group)
    except RuntimeError as error:  # a peer failed, left (its script ended), froze, or is in another collective
        failure = FailureGuard.shared().published_failure()
        if failure is not None:  # it published why
            raise failure from error
        raise RuntimeError(f"The per-step batch agreement failed: another rank has left the job, did not answer "
                           f"within the timeout (frozen or stuck), or is not taking this step ({error}). If no rank "
                           f"failed, every rank must run the same number of steps: give every data-parallel replica "
                           f"the same number of batches (plugin.prepare_dataloader, or a DistributedSampler over dp "
                           f"with drop_last=True), and call execute_pipeline on every rank.") from error
    rows = [r.tolist() for r in rows]
    if d.error is not None:  # this rank's own reason is the most specific one (after the all-gather: no hang)
        raise d.error
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(rows)))
    for rank, row in zip(ranks, rows):
        if row[1] != OK:
            raise _bad_batch(row, rank, limits)
    _check_replicas(rows, ranks, [k for k, _ in _tensors(batch)], fix)


def _bad_batch(row: List[int], rank: int, limits: BatchLimits) -> Exception:
    code, v = row[1], row[2]
    where = f"on rank {rank} (data-parallel replica {row[0]})"
    if code == BAD_ID:
        return IndexError(f"Token id {v} {where} is outside the vocabulary [0, {limits.vocab}): check the tokenizer "
                          f"against the model's vocab_size.")
    if code == BAD_LABEL:
        return IndexError(f"Label {v} {where} is out of bounds: labels must lie in [0, {limits.label_vocab}) or "
                          f"equal ignore_index={limits.ignore_index}.")
    if code == BAD_LENGTH:
        n = limits.sequence_multiple
        return ValueError(f"Sequence length {v} {where} is not a multiple of {n}: enable_sequence_parallelism "
                          f"splits the sequence over {limits.sequence_split}; pad the batches to a multiple of {n} "
                          f"(e.g. the tokenizer's pad_to_multiple_of={n}).")
    if code == BAD_MASK:
        pair, which, *dims = row[2:2 + _DETAIL_SLOTS]
        mask_key, token_keys = _MASKED[pair]
        return ValueError(f"{mask_key} {where} has shape {tuple(dims[:2])} but {token_keys[which]} has "
                          f"{tuple(dims[2:])}: the mask needs one entry per token; pad or truncate the mask together "
                          f"with the ids (e.g. one tokenizer call with padding=True for both).")
    return ValueError(f"The batch {where} cannot be split into microbatches (that rank raised the reason); every "
                      f"replica's batch must split (see num_microbatches / microbatch_size; a short last batch of "
                      f"an epoch: prepare_dataloader(..., drop_last=True)).")


def _check_replicas(rows: List[List[int]], ranks: Sequence[int], keys: List[str], fix: str) -> None:
    """Each rank's shapes, split and digests against those of the first rank of its replica (every replica is
    checked on every rank, so that all raise the same error)."""
    first: Dict[int, int] = {}
    for i, row in enumerate(rows):
        first.setdefault(row[0], i)
    for i, row in enumerate(rows):  # shapes first: they make the digests differ too
        j = first[row[0]]
        if row[_SPLIT:_DIGESTS] != rows[j][_SPLIT:_DIGESTS]:
            raise ValueError(f"The ranks of data-parallel replica {row[0]} got different batches: rank {ranks[j]} has "
                             f"{_shape_text(rows[j])}, rank {ranks[i]} has {_shape_text(row)}. {fix}.")
    for i, row in enumerate(rows):
        j = first[row[0]]
        slots = [s for s in range(_DIGEST_SLOTS) if row[_DIGESTS + s] != rows[j][_DIGESTS + s]]
        if slots:
            names = [n for s in slots for n in (keys[s:] if s == _DIGEST_SLOTS - 1 else keys[s:s + 1])]
            raise ValueError(f"The ranks of data-parallel replica {row[0]} got different batches: rank {ranks[j]} and "
                             f"rank {ranks[i]} have the same shapes but different contents of {names}. "
                             f"{fix}.")


def _shape_text(row: List[int]) -> str:
    m, shapes = row[_SPLIT], row[_SPLIT + 1:_SPLIT + 1 + row[_DIGESTS - 1]][:_SHAPE_SLOTS]
    out, i = [], 0
    while i < len(shapes):
        n = shapes[i]
        out.append(tuple(shapes[i + 1:i + 1 + n]))
        i += 1 + n
    return f"tensor shapes {out} in {m} microbatches"


@contextlib.contextmanager
def batch_agreed() -> Iterator[None]:
    """Model calls inside agreed on their batch already (execute_pipeline's microbatches): DirectCallCheck skips
    them."""
    token = _AGREED.set(True)
    try:
        yield
    finally:
        _AGREED.reset(token)


def _whole(batch: object) -> int:
    return 1


class DirectCallCheck:
    """Forward pre-hook (`with_kwargs=True`) of a boosted model with tp > 1 and pp = 1: a call the script makes
    itself (`model(**batch)`) first agrees on its inputs over the tp group (one small all-gather), so tp ranks given
    different sequence lengths or contents raise the same error instead of aborting in a tp collective. Positional
    inputs are compared as `args[i]`. The sequence length is left to the model (sequence parallelism checks it in
    training mode only)."""

    def __init__(self, limits: BatchLimits, dp_rank: int, tp_group: dist.ProcessGroup, device: torch.device) -> None:
        self.limits = limits._replace(sequence_multiple=1)
        self.dp_rank, self.tp_group, self.device = dp_rank, tp_group, device

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: Dict[str, Any]) -> None:
        if not _AGREED.get():
            batch = {**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}
            agree_on_batch(batch, self.limits, _whole, self.dp_rank, self.device, self.tp_group, SAME_DIRECT_CALL)


def label_vocab_of(model: torch.nn.Module) -> Optional[int]:
    """Size of the LM head's output (token labels are checked against it); None for other heads."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    return getattr(head, "out_features", None) or getattr(head, "num_embeddings", None)


def vocab_of(model: torch.nn.Module) -> Optional[int]:
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embedding, "num_embeddings", None)
