"""Ring attention over a sequence-parallel ProcessGroup: exact causal attention on zigzag-sharded rows, with the
model's own mask (packed documents, padding, sliding window: whatever transformers built) or position ids' documents.

Each rank holds its zigzag part (`ring_layout`) of the queries, keys and values. The forward runs sp steps; at step
t the rank attends its two query chunks to the key/value block of rank (rank - t) mod sp (two chunks) while that
block is already being passed on to the next rank (one batched isend/irecv per step, overlapped with the block
products). Partial results merge with a running log-sum-exp, so the output is the softmax over all keys; blocks
the mask masks fully are skipped, blocks it leaves whole run unmasked, diagonal blocks it leaves exactly causal run
as causal; each block is computed by `ring_blocks` (torch's fused attention kernel where the device has one, else
hand-written fp32 row tiles). The backward runs the same ring: the key/value blocks circulate again and their
gradient accumulators follow them one step behind (each rank adds its contribution to the accumulator it receives
and sends it on; after sp steps every accumulator is back at its owner). A rank holds at most two key/value blocks
and two accumulators (fp32) at a time; nothing is all-gathered but sharded position ids (documents="position_ids").

GQA: the query heads of one key/value head are multiplied against that head directly (no repeat). Attention sinks
(GPT-OSS `s_aux`, one logit per head joining each row's softmax) are supported; the sinks' gradient is this rank's
part (sum it over the group as for any replicated parameter). Logit soft-capping (Gemma 2's `softcap`: scores
become cap * tanh(scores / cap) before the mask) runs in the hand-written blocks, the tanh's slope in their backward.
Scores, softmax and the merged output are fp32.

`RingAttention` is a transformers attention function; `register_ring_attention(name, RingAttention(group))` registers it
with sdpa's (or eager's) mask function, so that the ring reads the very mask the one-process model builds.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .ring_blocks import Block, block_backward, block_forward, finite, merge
from .ring_layout import (BlockKind, BlockMasks, HeadGroups, ModelMask, analyse_mask, documents, gather_zigzag,
                          kv_grads, output_grad, output_layout, pack_kv, query_blocks, query_grad, unpack_kv,
                          zigzag_chunks)

__all__ = ["RingSpec", "ring_attention", "RingAttention", "register_ring_attention"]


class RingSpec(NamedTuple):
    """What one ring attention call needs besides the tensors; identical on every rank but `rank`."""
    group: Optional[ProcessGroup]
    world: int
    rank: int
    scale: float
    masks: Union[BlockMasks, ModelMask]
    softcap: Optional[float] = None  # logit soft-capping of the scaled scores (None: none)


# -- the ring --------------------------------------------------------------------------------------------------------
def _post(spec: RingSpec, sends: List[Tensor], recvs: List[Tensor]) -> List[dist.Work]:
    """Start receives from the previous rank and sends to the next one, in list order (receives first); the order
    of messages between two ranks is the order they were posted, as NCCL and gloo both match them."""
    prev, nxt = (spec.rank - 1) % spec.world, (spec.rank + 1) % spec.world
    ops = [dist.P2POp(dist.irecv, t, group=spec.group, group_peer=prev) for t in recvs]
    ops += [dist.P2POp(dist.isend, t, group=spec.group, group_peer=nxt) for t in sends]
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: List[dist.Work]) -> None:
    for work in works:
        work.wait()


def _blocks(spec: RingSpec, step: int) -> Iterator[Tuple[int, int, Block]]:
    """What to compute at `step`: (query slot, key slot, block) of each unskipped block (slots: the two local
    chunks)."""
    source = (spec.rank - step) % spec.world
    for qi, q_chunk in enumerate(zigzag_chunks(spec.world, spec.rank)):
        for ki, k_chunk in enumerate(zigzag_chunks(spec.world, source)):
            kind = spec.masks.kind(q_chunk, k_chunk)
            if kind is not BlockKind.SKIP:
                yield qi, ki, Block(kind, spec.masks, q_chunk, k_chunk, spec.softcap)


def _heads(x: Tensor, n: HeadGroups) -> Tensor:
    """[2, b, hkv, g*c, ...] -> the same memory as [2, b, h, c, ...] (query head h = kv_head * g + j)."""
    return x.view(2, n.b, n.hkv * n.g, n.c, *x.shape[4:])


def _ring_forward(q: Tensor, kv: Tensor, spec: RingSpec, n: HeadGroups) -> Tuple[Tensor, Tensor]:
    """Output [2, b, hkv, g*c, dv] (fp32) and log-sum-exp [2, b, hkv, g*c] of the local queries over all keys."""
    out = q.new_zeros((2, n.b, n.hkv, n.g * n.c, n.dv), dtype=torch.float32)
    lse = torch.full(out.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    queries, out_heads, lse_heads = _heads(q, n), _heads(out, n), _heads(lse, n)
    for step in range(spec.world):
        incoming = torch.empty_like(kv) if step < spec.world - 1 else None
        works = _post(spec, [kv], [incoming]) if incoming is not None else []
        keys, values = unpack_kv(kv, n)
        for qi, ki, block in _blocks(spec, step):
            merge(out_heads[qi], lse_heads[qi], *block_forward(queries[qi], keys[ki], values[ki], block))
        _wait(works)
        kv = incoming
    return out, lse


class _Rows(NamedTuple):
    """What the backward of every block reads per local query row, each [2, b, h, c, ...] (`_heads`)."""
    grad: Tensor  # the output's gradient, in the queries' dtype
    out: Tensor  # the final output, in the queries' dtype
    lse: Tensor  # the final log-sum-exp, fp32, made finite (`finite`)
    delta: Tensor  # rowsum(grad * final output), fp32


def _ring_backward(q: Tensor, kv: Tensor, rows: _Rows, spec: RingSpec, n: HeadGroups) -> Tuple[Tensor, Tensor]:
    """(dq [2, b, hkv, g*c, dk], d(kv) flat) in fp32. Accumulator of step t travels to the next rank, which holds
    that block at step t + 1; the one sent at the last step reaches the block's owner."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    queries, dq_heads = _heads(q, n), _heads(dq, n)
    sent: List[dist.Work] = []
    for step in range(spec.world):
        arriving = torch.empty(kv.shape, dtype=torch.float32, device=kv.device) if step > 0 else None
        incoming = torch.empty_like(kv) if step < spec.world - 1 else None
        works = _post(spec, [kv] if incoming is not None else [], [t for t in (arriving, incoming) if t is not None])
        acc = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        keys, values = unpack_kv(kv, n)
        dkeys, dvalues = unpack_kv(acc, n)
        for qi, ki, block in _blocks(spec, step):
            bq, bk, bv = block_backward(queries[qi], keys[ki], values[ki], *(t[qi] for t in rows), block)
            dq_heads[qi] += bq
            dkeys[ki] += bk
            dvalues[ki] += bv
        _wait(works)
        if arriving is not None:
            acc += arriving
        _wait(sent)
        sent = _post(spec, [acc], []) if spec.world > 1 else []
        kv = incoming if incoming is not None else kv
    if spec.world == 1:
        return dq, acc
    own = torch.empty_like(acc)
    _wait(_post(spec, [], [own]))
    _wait(sent)
    return dq, own


# -- sinks -----------------------------------------------------------------------------------------------------------
def _sink_rows(sinks: Tensor, n: HeadGroups) -> Tensor:
    """Each query row's sink logit, [1, hkv, g*c] (fp32)."""
    return sinks.float().view(1, n.hkv, n.g, 1).expand(1, n.hkv, n.g, n.c).reshape(1, n.hkv, n.g * n.c)


def _add_sinks(out: Tensor, lse: Tensor, sinks: Tensor, n: HeadGroups) -> None:
    """The sink logit joins each row's softmax denominator (and contributes no value): rescale in place."""
    total = torch.logaddexp(lse, _sink_rows(sinks, n))
    out.mul_(torch.exp(lse - total).unsqueeze(-1))
    lse.copy_(total)


def _sink_grad(lse: Tensor, delta: Tensor, sinks: Tensor, n: HeadGroups) -> Tensor:
    """d loss / d sink = -sum over rows of p_sink * delta (this rank's rows)."""
    p_sink = torch.exp(_sink_rows(sinks, n) - lse)
    return -(p_sink * delta).view(2, n.b, n.hkv, n.g, n.c).sum(dim=(0, 1, 4)).reshape(-1).to(sinks.dtype)


# -- autograd --------------------------------------------------------------------------------------------------------
class _RingAttentionFn(torch.autograd.Function):
    """(query [b, h, 2c, dk], key [b, hkv, 2c, dk], value [b, hkv, 2c, dv], sinks [h] or None) of this rank's
    zigzag part -> output [b, 2c, h, dv] in query's dtype."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, sinks: Optional[Tensor], spec: RingSpec) -> Tensor:
        b, h, s, dk = query.shape
        n = HeadGroups(b, key.shape[1], h // key.shape[1], s // 2, dk, value.shape[-1])
        q, kv = query_blocks(query, n).mul(spec.scale), pack_kv(key, value, n)  # scores = (scale * q) k^T
        out, lse = _ring_forward(q, kv, spec, n)
        if sinks is not None:
            _add_sinks(out, lse, sinks, n)
        ctx.save_for_backward(q, kv, out, lse, sinks)
        ctx.spec, ctx.heads, ctx.kv_meta = spec, n, (key.shape, key.dtype, value.shape, value.dtype)
        return output_layout(out.to(query.dtype), n)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        q, kv, out, lse, sinks = ctx.saved_tensors
        spec, n = ctx.spec, ctx.heads
        grad = output_grad(grad_output, n)
        delta = (grad.float() * out).sum(-1)
        rows = _Rows(*(_heads(t, n) for t in (grad.to(q.dtype), out.to(q.dtype), finite(lse), delta)))
        dq, dkv = _ring_backward(q, kv, rows, spec, n)
        dk, dv = kv_grads(dkv, n, *ctx.kv_meta)
        dsinks = _sink_grad(lse, delta, sinks, n) if sinks is not None and ctx.needs_input_grad[3] else None
        return query_grad(dq.mul_(spec.scale), n).to(q.dtype), dk, dv, dsinks, None


def ring_attention(query: Tensor, key: Tensor, value: Tensor, spec: RingSpec,
                   sinks: Optional[Tensor] = None) -> Tensor:
    """Causal attention of this rank's zigzag part of the queries over the whole (zigzag-sharded) sequence.

    Args:
        query: [b, h, 2c, dk], key: [b, hkv, 2c, dk], value: [b, hkv, 2c, dv]: this rank's zigzag part (chunks r
            and 2*sp-1-r of c tokens), h a multiple of hkv. Differentiable in all three.
        spec: group, its size and this rank, the softmax scale, the block masks and the soft-cap (`RingSpec`).
        sinks: optional per-head sink logits [h] (GPT-OSS), differentiable (this rank's part of their gradient).
    Returns:
        [b, 2c, h, dv], this rank's zigzag part of the output (transformers' attention output layout).
    Collective over `spec.group`: every rank calls it with the same shapes.
    """
    _check_shapes(query, key, value, sinks)
    return _RingAttentionFn.apply(query, key, value, sinks, spec)


def _check_shapes(query: Tensor, key: Tensor, value: Tensor, sinks: Optional[Tensor]) -> None:
    """Refuse (before any collective) shapes ring attention cannot take."""
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if not query.dim() == key.dim() == value.dim() == 4 or query.shape[:3:2] != key.shape[:3:2]:
        raise ValueError(f"ring attention takes [batch, heads, sequence, head_dim] tensors, keys and values for "
                         f"exactly this rank's queries (no cache, no cross-attention); got {shapes}.")
    if query.shape[1] % key.shape[1] or value.shape[:3] != key.shape[:3] or query.shape[2] % 2:
        raise ValueError(f"ring attention needs query heads a multiple of key/value heads and an even local length "
                         f"(two zigzag chunks); got {shapes}.")
    if sinks is not None and sinks.shape != (query.shape[1],):
        raise ValueError(f"attention sinks must hold one logit per query head ({query.shape[1]}); got "
                         f"{tuple(sinks.shape)}.")


# -- transformers adapter --------------------------------------------------------------------------------------------
_MODES = ("mask", "position_ids", "causal")
_CACHE_SIZE = 8  # distinct masks / position tensors remembered (a model with full and sliding layers has two)


@dataclass
class RingAttention:
    """A transformers attention function (`module, query, key, value, attention_mask, scaling, dropout,
    sliding_window, **kwargs` -> (output [b, s, h, d], None)) running ring attention over `group` on the layers'
    zigzag-sharded sequence. Which keys each query sees, by `documents`:

    - "mask" (the default): the model's own mask, so the ring equals the one-process model whatever transformers
      decided (packed documents only without a 2-D attention_mask and without a cache, padding, sliding-window layers'
      masks). `attention_mask` must then be the 4-D mask of the FULL sequence ([b or 1, 1, S, S], S = local length *
      sp, natural order; bool as sdpa's, or additive 0 / -inf-or-minimum as eager's; `register_ring_attention` has
      the model build it); each block is its slice. None means a plain causal row (what sdpa's mask function returns
      then): causal, with `sliding_window` if the layer gives one. Rows without any key give what sdpa gives (0), or
      with an eager (finite minimum) mask what eager gives (uniform over the row's keys).
    - "position_ids" (the default when `position_ids` is set): causal within the documents of, in this order,
      `position_ids` if set (the full batch's, [S] or [b, S]: set it per batch), else the `position_ids` keyword the
      layer passes (full length, or this rank's zigzag part, then all-gathered: a collective), else one document per
      row; and the module's sliding window. `attention_mask` is not read (padding must be its own document(s)).
    - "causal": one causal row (and the sliding window); neither the mask nor position ids are read.

    Masks and documents are analysed once per distinct tensor (remembered by identity while it lives).
    """
    group: Optional[ProcessGroup]
    position_ids: Optional[Tensor] = None
    documents: Optional[str] = None
    _cache: Dict[Tuple[int, bool], Tuple["weakref.ref[Tensor]", object]] = field(default_factory=dict, init=False,
                                                                               repr=False)

    def __post_init__(self) -> None:
        if self.documents is None:
            self.documents = "position_ids" if self.position_ids is not None else "mask"
        if self.documents not in _MODES:
            raise ValueError(f"RingAttention(documents=...) is one of {_MODES}; got {self.documents!r}.")

    # eager inside a compiled layer (regional compilation): its point-to-point ring and its mask analysis (data
    # dependent, cached by tensor identity) are one graph break between the layer's compiled graphs
    @torch.compiler.disable
    def __call__(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                 scaling: Optional[float] = None, dropout: float = 0.0, sliding_window: Optional[int] = None,
                 **kwargs: Any) -> Tuple[Tensor, None]:
        _check_module(module, dropout, kwargs)
        _check_shapes(query, key, value, kwargs.get("s_aux"))
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        masks = self._masks(attention_mask, sliding_window, query.shape[0], query.shape[2], world, kwargs)
        scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
        spec = RingSpec(self.group, world, rank, scale, masks, kwargs.get("softcap"))
        return _RingAttentionFn.apply(query, key, value, kwargs.get("s_aux"), spec), None

    def _masks(self, attention_mask: Any, window: Optional[int], batch: int, local: int, world: int,
               kwargs: dict) -> Union[BlockMasks, ModelMask]:
        chunk = local // 2
        if self.documents == "causal" or (self.documents == "mask" and attention_mask is None):
            return BlockMasks(chunk, window)
        if self.documents == "mask":
            _check_mask(attention_mask, batch, local * world)
            uniform = kwargs.get("s_aux") is None
            rows, kinds = self._cached(attention_mask, uniform, lambda: analyse_mask(attention_mask, world, uniform))
            return ModelMask(chunk, attention_mask, rows, kinds)
        source = self.position_ids if self.position_ids is not None else kwargs.get("position_ids")
        if source is None:
            return BlockMasks(chunk, window)
        rows = source.shape[0] if source.dim() == 2 else 1
        if source.dim() > 2 or source.shape[-1] not in (local, local * world) or rows not in (1, batch):
            raise ValueError(f"ring attention: position_ids {tuple(source.shape)} are neither the full sequence's "
                             f"[{batch}, {local * world}] nor this rank's zigzag part [{batch}, {local}].")

        def docs():
            full = source if source.shape[-1] != local or world == 1 else \
                gather_zigzag(source, self.group, dim=source.dim() - 1)
            return documents(full, world)
        return BlockMasks(chunk, window, self._cached(source, False, docs))

    def _cached(self, tensor: Tensor, flag: bool, make):
        """make() for `tensor`, computed once while that very tensor lives (weak reference, identity)."""
        entry = self._cache.get((id(tensor), flag))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        value = make()
        for key in [k for k, (ref, _) in self._cache.items() if ref() is None]:
            del self._cache[key]
        while len(self._cache) >= _CACHE_SIZE:
            self._cache.pop(next(iter(self._cache)))
        self._cache[(id(tensor), flag)] = (weakref.ref(tensor), value)
        return value


def register_ring_attention(name: str, ring: RingAttention, like: str = "sdpa") -> None:
    """Register `ring` as transformers attention implementation `name` (set `config._attn_implementation = name`)
    together with the mask function of `like` ("sdpa": bool masks, None for a plain causal row; "eager": additive
    float masks), so that the model's forward builds for the full sequence the very mask it builds with
    attn_implementation=like, and the ring equals that one-process model (rows without any key included)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask, sdpa_mask
    masks = {"sdpa": sdpa_mask, "eager": eager_mask}
    if like not in masks:
        raise ValueError(f"register_ring_attention(like=...) is 'sdpa' or 'eager'; got {like!r}.")
    AttentionInterface.register(name, ring)
    AttentionMaskInterface.register(name, masks[like])


def _check_mask(mask: object, batch: int, length: int) -> None:
    """Refuse (before any collective) a mask that is not the model's 4-D mask of the full sequence."""
    shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
    if not isinstance(mask, Tensor) or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, batch) \
            or tuple(mask.shape[-2:]) != (length, length) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise ValueError(f"ring attention (documents='mask') reads the model's own 4-D mask of the full sequence, "
                         f"[{batch}, 1, {length}, {length}] bool or additive float in sequence order; got {shape}. Let "
                         f"the model build it before its layers run, on the full sequence, with sdpa's or eager's mask "
                         f"function registered under the ring's name (register_ring_attention), or use "
                         f"RingAttention(documents='position_ids').")


def _check_module(module: nn.Module, dropout: float, kwargs: dict) -> None:
    """Refuse (before any collective) what ring attention does not compute."""
    name = type(module).__name__
    if dropout:
        raise NotImplementedError(f"ring attention has no attention dropout ({name} asks for p={dropout}); set the "
                                  f"model's attention dropout to 0 (e.g. config.attention_dropout=0.0).")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise NotImplementedError(f"ring attention is causal (zigzag load balancing); {name} is bidirectional.")
