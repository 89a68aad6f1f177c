"""torch's fused attention kernels that return the log-sum-exp, by device type, as ring attention's blocks call them
(ring_blocks.py): softmax scale 1 (the queries come scaled), no dropout, an additive 0/-inf mask or `is_causal` (the
diagonal of a square block).

- CPU: the flash attention kernel `_scaled_dot_product_flash_attention_for_cpu` and its backward; it groups query
  heads over key/value heads itself (query head h reads kv head h // g, as transformers' repeat_kv).
- CUDA: the memory-efficient kernel `_scaled_dot_product_efficient_attention` (fp32, bf16 and fp16, with a mask;
  the flash kernel takes neither fp32 nor a mask) and its backward. It takes as many key/value heads as query heads:
  they are repeated (repeat_kv's order) and their gradients summed back per kv head. Its log-sum-exp comes padded to
  a multiple of 32 rows, and its mask needs rows aligned to 16 elements: both are padded here. Its backward takes the
  output and its gradient in the forward output's memory layout ([b, c, h, d]): in bf16 another layout gave wrong
  query and key gradients on an H200 (torch 2.11), fp32 did not.
"""
from __future__ import annotations

from typing import Callable, Dict, FrozenSet, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["FusedKernels", "FUSED"]

_LSE_ROWS = 32  # the memory-efficient kernel's log-sum-exp: rows padded to a multiple of this
_BIAS_ALIGN = 16  # and its mask's row stride: a multiple of this many elements


class FusedKernels(NamedTuple):
    """A device's attention kernels with log-sum-exp."""
    forward: Callable[[Tensor, Tensor, Tensor, bool, Optional[Tensor]], Tuple[Tensor, Tensor]]
    # (q, k, v, is_causal, additive mask or None) -> (output [b, h, c, dv], log-sum-exp [b, h, c])
    backward: Callable[..., Tuple[Tensor, Tensor, Tensor]]
    # (grad, q, k, v, output, log-sum-exp, is_causal, additive mask or None) -> (dq, dk, dv)
    dtypes: FrozenSet[torch.dtype]


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                      scale=1.0)


def _cpu_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                  bias: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=1.0)


def _heads(q: Tensor, t: Tensor) -> Tensor:
    """Key or value heads repeated to the query heads (head h reads kv head h // g)."""
    g = q.shape[1] // t.shape[1]
    return t if g == 1 else t.repeat_interleave(g, dim=1)


def _aligned_bias(bias: Optional[Tensor], heads: int) -> Optional[Tensor]:
    """The mask [B, 1, c, c] broadcast over heads, in a buffer whose rows are 16-element aligned."""
    if bias is None:
        return None
    b, _, rows, cols = bias.shape
    padded = -(-cols // _BIAS_ALIGN) * _BIAS_ALIGN
    buffer = bias.new_zeros(b, 1, rows, padded)[..., :cols]
    buffer.copy_(bias)
    return buffer.expand(b, heads, rows, cols)


def _cuda_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _heads(q, k), _heads(q, v), _aligned_bias(bias, q.shape[1]), True, 0.0, causal, scale=1.0)
    if bias is not None:  # rows without any key: output 0 (the kernel may leave nan there)
        out = out.masked_fill(torch.isneginf(bias).all(-1, keepdim=True), 0.0)
    return out, lse[..., :q.shape[2]]


def _as_forward_output(t: Tensor) -> Tensor:
    """[b, h, c, d] laid out as the forward returns its output: [b, c, h, d] in memory. The half-precision backward
    reads the output (for rowsum(grad * output)) in that layout whatever its strides say; fp32's follows them."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _cuda_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                   bias: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    rows = q.shape[2]
    padded = lse.new_zeros(*lse.shape[:-1], -(-rows // _LSE_ROWS) * _LSE_ROWS)
    padded[..., :rows] = lse
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: the seed and offset are not read
    aligned = _aligned_bias(bias, q.shape[1])
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        _as_forward_output(grad), q, _heads(q, k), _heads(q, v), aligned, _as_forward_output(out), padded, no_rng,
        no_rng, 0.0, [True, True, True, False], causal, scale=1.0)
    g = q.shape[1] // k.shape[1]
    if g > 1:  # each kv head's gradient: the sum over the query heads that read it
        dk = dk.unflatten(1, (k.shape[1], g)).sum(2)
        dv = dv.unflatten(1, (v.shape[1], g)).sum(2)
    return dq, dk, dv


_HALF_AND_FULL = frozenset({torch.float32, torch.bfloat16, torch.float16})

FUSED: Dict[str, FusedKernels] = {  # device type -> fused kernels; others use the hand-written blocks
    "cpu": FusedKernels(_cpu_forward, _cpu_backward, _HALF_AND_FULL),
    "cuda": FusedKernels(_cuda_forward, _cuda_backward, _HALF_AND_FULL),
}
