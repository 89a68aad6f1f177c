"""Cross-entropy of a linear layer's output (the LM head) computed a chunk of tokens at a time: the [tokens, vocab]
logits are never held whole, only one chunk's.

`linear_cross_entropy_sum(hidden, weight, bias, targets, ...)` is the sum over tokens of
`F.cross_entropy(transform(hidden @ weight.T + bias).float(), targets, reduction="none")` (0 where a target is
`ignore_index`). The forward computes, chunk by chunk, the logits, their log-sum-exp and target logit, and at once
the gradients of the sum with respect to the hidden states, the weight and the bias (softmax minus one-hot, through
the transform), as Liger-Kernel's fused linear cross-entropy does; the backward only scales them by the incoming
gradient. So the logits are computed once (no recomputation in backward), and what lives from forward to backward
is the gradients (the hidden states' size, the weight's size), not the logits.

Vocab-parallel: `weight` may hold this rank's rows (vocabulary columns) of a head split over a tp group; each chunk's
max is all-reduced (MAX) and its sum of exponentials and target logit (SUM, one collective), as
`loss.vocab_parallel_cross_entropy` does on whole logits. The hidden states' gradient is then this rank's partial
sum: the caller passes `hidden` through `copy_to_tp`, whose backward sums it over the group. Columns at global index
>= `VocabShard.size` (vocabulary padding) are masked out.

Compiled (`compiled=True`, the plugin's compile_layers): each chunk's arithmetic (logits, transform, max, exponentials,
sums, softmax minus one-hot, cast) runs as one torch.compile'd function, its all-reduces traced as torch's functional
collectives, so the logits chunk is read a few times by fused kernels instead of once per eager operation (on an H200,
Llama-3.2-1B shape, 8k tokens: the eager chunks cost ~18 ms a step over transformers' full-logits loss).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from .comm import get_tp_world_size

__all__ = ["VocabShard", "LogitTransform", "linear_cross_entropy_sum", "chunk_tokens"]


class VocabShard(NamedTuple):
    """The vocabulary columns the head's `weight` rows are: global index of the first, the true vocabulary size
    (columns beyond it are padding) and the tp group the columns are split over (None: all of them here)."""
    start: int
    size: int
    group: Optional[ProcessGroup] = None


class LogitTransform(NamedTuple):
    """What the model's forward does to the head's output before its loss: `logits * scale`, then, with `softcap`,
    `softcap * tanh(logits / softcap)` (Gemma 2's final_logit_softcapping), in the head's dtype, as the model does."""
    scale: float = 1.0
    softcap: Optional[float] = None

    def apply(self, z: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """The transformed logits and, with a softcap, the tanh (its derivative needs it)."""
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap is None:
            return z, None
        t = torch.tanh(z / self.softcap)
        return t * self.softcap, t

    def chain(self, grad: Tensor, t: Optional[Tensor]) -> Tensor:
        """The gradient with respect to the head's output from the one with respect to the transformed logits."""
        if t is not None:
            grad.mul_(1.0 - t.float().square())
        if self.scale != 1.0:
            grad.mul_(self.scale)
        return grad


MAX_CHUNK_LOGITS = 1 << 27  # logits per chunk the rule below grows to at most (512 MiB in fp32)


def _floor_pow2(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def chunk_tokens(tokens: int, hidden: int, columns: int, given: Optional[int]) -> int:
    """Tokens per chunk: `given`, else a power of two, at least 256 (small matrix products are slow), at most
    `tokens`: as many as make a chunk's logits about the size of all the hidden states (Liger's rule), or more, up
    to a quarter of the tokens and MAX_CHUNK_LOGITS logits: every chunk reads and writes the whole weight gradient
    (its accumulation), so few chunks run faster (H200, 8k tokens, vocab 128k: 256 -> 2048 tokens per chunk saved
    10 ms a step), while a quarter of the logits still keeps the loss's memory far below the full logits'."""
    if given is not None:
        return max(1, min(given, tokens))
    per = -(-columns // hidden)  # ceil(columns / hidden)
    rows = 1 << max(0, (-(-tokens // per) - 1).bit_length())
    grown = min(_floor_pow2(max(1, tokens // 4)), _floor_pow2(max(1, MAX_CHUNK_LOGITS // max(1, columns))))
    return max(1, min(tokens, max(rows, grown, 256)))


def _all_reduce(x: Tensor, group: Optional[ProcessGroup], op=dist.ReduceOp.SUM) -> Tensor:
    if group is None or get_tp_world_size(group) == 1:  # (None: the whole vocabulary is here, not the world)
        return x
    if torch.compiler.is_compiling():  # traced into the compiled chunk
        return funcol.wait_tensor(funcol.all_reduce(x, "max" if op == dist.ReduceOp.MAX else "sum", group))
    dist.all_reduce(x, op=op, group=group)
    return x


class _Chunk(NamedTuple):
    losses: Tensor            # per token, fp32, 0 where ignored
    grad: Optional[Tensor]    # d(sum of losses) / d(head output), the weight's dtype; None without gradients


def _chunk(h: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, vocab: VocabShard,
           transform: LogitTransform, ignore_index: int, want_grad: bool) -> _Chunk:
    """One chunk of tokens: its logits, losses and (with `want_grad`) the gradient of their sum w.r.t. the logits."""
    z, t = transform.apply(F.linear(h, weight, bias))
    x = z.float()
    local = x.size(-1)
    if vocab.start + local > vocab.size:  # vocabulary padding: never a prediction
        x[:, max(0, vocab.size - vocab.start):] = float("-inf")
    x.sub_(_all_reduce(x.max(dim=-1).values, vocab.group, dist.ReduceOp.MAX).unsqueeze(-1))
    valid = targets != ignore_index
    owned = valid & (targets >= vocab.start) & (targets < vocab.start + local)
    column = torch.where(owned, targets - vocab.start, 0)
    picked = torch.where(owned, x.gather(-1, column.unsqueeze(-1)).squeeze(-1), 0.0)
    x.exp_()
    sums = _all_reduce(torch.stack([x.sum(dim=-1), picked]), vocab.group)  # one collective for both
    losses = torch.where(valid, sums[0].log() - sums[1], 0.0)
    if not want_grad:
        return _Chunk(losses, None)
    x.div_(sums[0].unsqueeze(-1))  # softmax
    x[torch.arange(x.size(0), device=x.device), column] -= owned.to(x.dtype)
    x.mul_(valid.unsqueeze(-1).to(x.dtype))
    return _Chunk(losses, transform.chain(x, t).to(weight.dtype))


@functools.lru_cache(maxsize=None)
def _compiled_chunk() -> Callable[..., _Chunk]:
    return torch.compile(_chunk)


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum of token losses of `hidden @ weight.T + bias`; gradients computed in forward, scaled in backward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, vocab: VocabShard,
                transform: LogitTransform, chunk: int, ignore_index: int, want_grad: bool, compiled: bool) -> Tensor:
        grad_h = torch.zeros_like(hidden) if want_grad and ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if want_grad and ctx.needs_input_grad[1] else None
        grad_b = torch.zeros_like(bias) if want_grad and bias is not None and ctx.needs_input_grad[2] else None
        total = hidden.new_zeros((), dtype=torch.float32)
        compute = _compiled_chunk() if compiled else _chunk
        for lo in range(0, hidden.size(0), chunk):
            h = hidden[lo:lo + chunk]
            part = compute(h, weight, bias, targets[lo:lo + chunk], vocab, transform, ignore_index, want_grad)
            total += part.losses.sum()
            if grad_h is not None:
                grad_h[lo:lo + chunk] = part.grad @ weight
            if grad_w is not None:
                grad_w.addmm_(part.grad.t(), h)
            if grad_b is not None:
                grad_b += part.grad.sum(0)
        # saved (not attributes): saved-tensor hooks (offloading, memory accounting) see them
        ctx.save_for_backward(grad_h, grad_w, grad_b, (targets != ignore_index).any())
        ctx.used = False
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        if ctx.used:
            raise RuntimeError("The chunked linear cross-entropy computes its gradients in forward and hands them out "
                               "once; compute the loss again instead of backpropagating it twice (retain_graph).")
        ctx.used = True  # the gradients are scaled in place: they serve one backward
        *grads, any_valid = ctx.saved_tensors
        # every target ignored: the gradients are exactly 0, as torch's (a mean over no target has an infinite
        # incoming gradient, which must not turn them into nan); a tensor condition, no device synchronisation
        scale = torch.where(any_valid, grad_total, torch.zeros_like(grad_total))
        out = [g if g is None else g.mul_(scale) for g in grads]
        return (*out, None, None, None, None, None, None, None)


def linear_cross_entropy_sum(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                             vocab: VocabShard, transform: LogitTransform = LogitTransform(),
                             chunk: Optional[int] = None, ignore_index: int = -100, compiled: bool = False) -> Tensor:
    """Sum over tokens of the cross-entropy of `transform(hidden @ weight.T + bias)` against `targets` (global
    vocabulary ids, `ignore_index` for none), chunk by chunk (`chunk` tokens; None: `chunk_tokens`'s choice).

    `hidden` is (tokens, features), `targets` (tokens,), `weight` this rank's (columns, features) rows of the head
    (see VocabShard). Targets outside the vocabulary must have been refused by the caller. `compiled`: each chunk's
    arithmetic runs torch.compile'd (the module docstring)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and targets {tuple(targets.shape)} do not match: "
                         f"expected (tokens, features) and (tokens,).")
    rows = chunk_tokens(hidden.size(0), hidden.size(1), weight.size(0), chunk)
    want_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, vocab, transform, rows, ignore_index, want_grad,
                                     compiled)
