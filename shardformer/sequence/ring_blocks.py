"""One block of ring attention: softmax attention of one query chunk over one key chunk, forward and backward.

Two implementations, one math:
- fused: torch's own attention kernels that return the log-sum-exp (`FUSED`, by device type, ring_kernels.py: CPU's
  flash attention kernel, CUDA's memory-efficient one). A block runs whole (the kernel tiles it
  itself); a CAUSAL block with is_causal (its upper triangle is never computed), a MASKED block with an additive
  -inf mask (rows without any key there get log-sum-exp -inf, output 0). Key and value heads are passed as they
  are (the kernels group query heads themselves, as transformers' repeat_kv: query head h reads kv head h // g).
- hand-written (the fallback): fp32 matmul / softmax in row tiles of at most `TILE_BYTES` of scores, for devices
  without fused kernels, dtypes they lack, key and value head dims that differ, blocks with rows
  uniform over their keys (eager's finite-minimum mask on rows without any key: scores replaced by 0, which no
  additive mask expresses), and logit soft-capping (Gemma 2's `cap * tanh(scores / cap)` before the mask, which
  the fused kernels cannot apply; its backward multiplies the scores' gradient by the tanh's slope
  1 - tanh(scores / cap)^2).
Both backwards recompute the probabilities from the FINAL (global) log-sum-exp and use the final output (delta =
rowsum(grad * output)), so the gradient contributions of the blocks sum to the exact total.

Layout: queries [b, h, c, dk] already multiplied by the softmax scale (scores = q k^T), keys [b, hkv, c, dk],
values [b, hkv, c, dv], h a multiple of hkv. With the fused kernels a block's output is in the queries' dtype
(bf16 inputs: rounded once per block before the fp32 merge); the hand-written path keeps it fp32.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from .ring_kernels import FUSED, FusedKernels
from .ring_layout import BlockKind, BlockMasks, ModelMask

__all__ = ["Block", "FusedKernels", "FUSED", "TILE_BYTES", "block_forward", "block_backward", "merge", "finite"]

Mask = Optional[Tuple[Tensor, Optional[Tensor]]]  # (masked pairs [B, 1, c, c], uniform rows [B, 1, c, 1] or None)


class Block(NamedTuple):
    """One unskipped (query chunk, key chunk) product, FULL, CAUSAL or MASKED; its mask is built on demand.
    `softcap`: the scores are soft-capped (cap * tanh(scores / cap)) before the mask (None: not)."""
    kind: BlockKind
    masks: Union[BlockMasks, ModelMask]
    q_chunk: int
    k_chunk: int
    softcap: Optional[float] = None

    def mask(self, device: torch.device) -> Mask:
        return self.masks.masked(self.q_chunk, self.k_chunk, device), self.masks.uniform(self.q_chunk, device)


TILE_BYTES = {"cpu": 8 << 20, None: 256 << 20}  # hand-written path: fp32 scores per row tile, by device type


# -- dispatch --------------------------------------------------------------------------------------------------------
def _route(q: Tensor, v: Tensor, block: Block) -> Tuple[Optional[FusedKernels], Mask]:
    """The fused kernels for this block (None: the hand-written path) and the mask that path reads (None: none)."""
    fused = FUSED.get(q.device.type) if block.softcap is None else None
    if fused is not None and (q.dtype not in fused.dtypes or q.shape[-1] != v.shape[-1]):
        fused = None
    if block.kind is BlockKind.FULL or (fused is not None and block.kind is BlockKind.CAUSAL):
        return fused, None
    mask = block.mask(q.device)
    return (fused if mask[1] is None else None), mask


def _bias(mask: Mask, dtype: torch.dtype) -> Optional[Tensor]:
    """The additive form (0 / -inf, in the queries' dtype) of a block's masked pairs, as the fused kernels take it."""
    return None if mask is None else torch.zeros(mask[0].shape, dtype=dtype, device=mask[0].device).masked_fill_(
        mask[0], float("-inf"))


def block_forward(q: Tensor, k: Tensor, v: Tensor, block: Block) -> Tuple[Tensor, Tensor]:
    """(output [b, h, c, dv] normalized over this block's keys; its log-sum-exp [b, h, c] fp32, -inf for rows
    without any key here, whose output is 0)."""
    fused, mask = _route(q, v, block)
    if fused is None:
        return _hand_forward(q, k, v, mask, block.softcap)
    out, lse = fused.forward(q, k, v, block.kind is BlockKind.CAUSAL, _bias(mask, q.dtype))
    lse = lse.float()
    if mask is not None:  # the kernel gives a row without any key output 0 but log-sum-exp 0
        lse.masked_fill_(mask[0].all(-1), float("-inf"))
    return out, lse


def block_backward(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, out: Tensor, lse: Tensor, delta: Tensor,
                   block: Block) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block for the scaled queries [b, h, c, dk] (multiply by the scale for the queries'), keys
    and values. `grad` and the final `out` [b, h, c, dv] in the queries' dtype, the final log-sum-exp `lse` [b, h, c]
    fp32 made finite (`finite`: a row without any key has no probability anywhere), `delta` = rowsum(grad * out)."""
    fused, mask = _route(q, v, block)
    if fused is None:
        return _hand_backward(q, k, v, grad, lse, delta, mask, block.softcap)
    return fused.backward(grad, q, k, v, out, lse, block.kind is BlockKind.CAUSAL, _bias(mask, q.dtype))


def finite(lse: Tensor) -> Tensor:
    """-inf (a row with no key yet) -> 0, so that exp(score - lse) is 0 instead of nan there."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """out, lse (in place, fp32) := the softmax over the keys of both (log-sum-exp weighting)."""
    new = torch.logaddexp(lse, block_lse)
    safe = finite(new)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(new)


# -- hand-written path: each key/value head's query heads stacked along the rows, in row tiles ----------------------
def _tiles(b: int, hkv: int, g: int, c: int, device: torch.device) -> Iterator[Tuple[slice, slice]]:
    """(stacked query rows, their positions in the chunk) per row tile: a tile lies inside one query head, at most
    `TILE_BYTES` of fp32 scores (whole blocks are ~2x slower on CPU at c=4096: the scores leave the cache)."""
    size = max(1, min(c, TILE_BYTES.get(device.type, TILE_BYTES[None]) // (4 * b * hkv * c)))
    for j in range(g):
        for r in range(0, c, size):
            yield slice(j * c + r, j * c + min(r + size, c)), slice(r, min(r + size, c))


def _tile_mask(mask: Mask, positions: slice) -> Mask:
    return None if mask is None else tuple(None if m is None else m[:, :, positions] for m in mask)


def _scores(q: Tensor, k: Tensor, mask: Mask, softcap: Optional[float] = None,
            slope: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """fp32 scores [b, hkv, rows, c], soft-capped if `softcap`; masked pairs are -inf, the other pairs of uniform
    rows 0 (their softmax is uniform; gradients flow through the scores as in eager). With `slope` and `softcap`,
    also d(capped) / d(scores) = 1 - tanh(scores / cap)^2 of every pair (else None)."""
    s = torch.matmul(q, k.transpose(-1, -2)).float()
    gain = None
    if softcap is not None:
        s.div_(softcap).tanh_()
        gain = 1.0 - s * s if slope else None
        s.mul_(softcap)
    if mask is None:
        return s, gain
    masked, uniform = mask
    if uniform is not None:
        s.masked_fill_(uniform, 0.0)
    return s.masked_fill_(masked, float("-inf")), gain


def _hand_forward(q: Tensor, k: Tensor, v: Tensor, mask: Mask, softcap: Optional[float]) -> Tuple[Tensor, Tensor]:
    b, h, c, dk = q.shape
    hkv = k.shape[1]
    stacked = q.reshape(b, hkv, h // hkv * c, dk)
    out = torch.empty(b, hkv, h // hkv * c, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.empty(out.shape[:-1], dtype=torch.float32, device=q.device)
    for rows, positions in _tiles(b, hkv, h // hkv, c, q.device):
        s, _ = _scores(stacked[:, :, rows], k, _tile_mask(mask, positions), softcap)
        top = finite(s.amax(dim=-1, keepdim=True))
        p = s.sub_(top).exp_()
        total = p.sum(dim=-1, keepdim=True)
        lse[:, :, rows] = (top + total.log()).squeeze(-1)
        out[:, :, rows] = torch.matmul(p.to(v.dtype), v).float().div_(total.clamp_min_(torch.finfo(total.dtype).tiny))
    return out.view(b, h, c, -1), lse.view(b, h, c)


def _hand_backward(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, lse: Tensor, delta: Tensor,
                   mask: Mask, softcap: Optional[float]) -> Tuple[Tensor, Tensor, Tensor]:
    b, h, c, dk = q.shape
    hkv = k.shape[1]
    stacked = [t.reshape(b, hkv, h // hkv * c, *t.shape[3:]) for t in (q, grad, lse, delta)]
    dq = torch.empty(stacked[0].shape, dtype=torch.float32, device=q.device)
    dkey = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dvalue = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for rows, positions in _tiles(b, hkv, h // hkv, c, q.device):
        tq, tgrad, tlse, tdelta = (t[:, :, rows] for t in stacked)
        s, gain = _scores(tq, k, _tile_mask(mask, positions), softcap, slope=True)
        p = s.sub_(tlse.unsqueeze(-1)).exp_()
        dvalue += torch.matmul(p.to(tgrad.dtype).transpose(-1, -2), tgrad)
        ds = torch.matmul(tgrad, v.transpose(-1, -2)).float().sub_(tdelta.unsqueeze(-1)).mul_(p)
        ds = (ds if gain is None else ds.mul_(gain)).to(tq.dtype)
        dq[:, :, rows] = torch.matmul(ds, k)
        dkey += torch.matmul(ds.transpose(-1, -2), tq)
    return dq.view(b, h, c, dk), dkey, dvalue
