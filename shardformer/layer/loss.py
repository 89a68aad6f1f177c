"""Cross-entropy over vocab-sharded logits that never materialises the full logits."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from .comm import get_tp_world_size, reduce_from_tp
from ..sequence.ring_layout import shard_zigzag

__all__ = ["vocab_parallel_cross_entropy", "parallel_causal_lm_loss", "TokenShard", "causal_lm_loss_on_tokens",
           "check_targets", "shifted_targets"]


def _all_reduce(x: Tensor, group: ProcessGroup | None, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
    if get_tp_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def check_targets(target: Tensor, ignore_index: int, vocab_size: int) -> None:
    """Refuse targets outside [0, vocab_size) as F.cross_entropy does; every tp rank holds the same targets, so each
    raises the same error before the first collective (masking them would train on garbage)."""
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"labels have dtype {target.dtype}, but the vocab-parallel cross-entropy takes token ids: pass "
                        f"integer labels (e.g. labels.long()), with ignore_index={ignore_index} for tokens without a "
                        f"loss.")
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise IndexError(f"Target {value} is out of bounds: labels must lie in [0, {vocab_size}) (the vocabulary) or "
                         f"equal ignore_index={ignore_index}. Check the tokenizer and the model's vocab_size.")


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross entropy of (N, V_local) fp32 logits; gradient softmax - onehot on the local shard."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group, vocab_start: int, vocab_size: int | None,
                ignore_index: int) -> Tensor:
        n_local = logits.size(-1)
        check_targets(target, ignore_index, vocab_size if vocab_size is not None else n_local * get_tp_world_size(group))
        x = logits.float()
        if vocab_size is not None and vocab_start + n_local > vocab_size:
            padded = torch.arange(vocab_start, vocab_start + n_local, device=x.device) >= vocab_size
            x = x.masked_fill(padded, float("-inf"))
        x = x - _all_reduce(x.max(dim=-1).values, group, dist.ReduceOp.MAX).unsqueeze(-1)

        valid = target != ignore_index
        owned = valid & (target >= vocab_start) & (target < vocab_start + n_local)
        local_target = torch.where(owned, target - vocab_start, 0)
        exp = x.exp()
        picked = torch.where(owned, x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)
        stats = _all_reduce(torch.stack([exp.sum(dim=-1), picked]), group)  # one collective for both sums
        sum_exp, target_logit = stats[0], stats[1]
        loss = torch.where(valid, sum_exp.log() - target_logit, 0.0)

        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local_target, owned, valid)
        ctx.in_dtype, ctx.used = logits.dtype, False
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        if ctx.used:
            raise RuntimeError("The vocab-parallel cross-entropy computes its gradient in its saved softmax, so it "
                               "supports one backward pass; compute the loss again instead of retain_graph=True.")
        ctx.used = True
        grad, local_target, owned, valid = ctx.saved_tensors  # the softmax, turned into the gradient in place
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows, local_target] -= owned.to(grad.dtype)
        # where, not a product: a mean over zero targets has an infinite grad_loss, whose ignored rows get 0 (torch)
        grad.mul_(torch.where(valid, grad_loss, 0.0).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: Tensor,
    target: Tensor,
    tp_group: ProcessGroup | None,
    vocab_start: int,
    ignore_index: int = -100,
    reduction: str = "mean",
    vocab_size: int | None = None,
) -> Tensor:
    """Cross entropy of logits sharded along the last (vocab) dim, equal to F.cross_entropy on the full logits.

    `vocab_start` is the global index of this rank's first column; columns at global index >= `vocab_size`
    (vocab padding) are ignored. "mean" averages over targets != ignore_index.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"unknown reduction {reduction!r}")
    flat_target = target.reshape(-1)
    loss = _VocabParallelCE.apply(local_logits.reshape(-1, local_logits.size(-1)), flat_target, tp_group,
                                  vocab_start, vocab_size, ignore_index)
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (flat_target != ignore_index).sum()


def parallel_causal_lm_loss(
    logits: Tensor,
    labels: Tensor,
    vocab_size: int,
    tp_group: ProcessGroup | None,
    vocab_start: int,
    ignore_index: int = -100,
    num_items_in_batch: Tensor | int | None = None,
    shift_labels: Tensor | None = None,
    **kwargs,
) -> Tensor:
    """Vocab-parallel counterpart of transformers' ForCausalLMLoss: next-token loss on vocab-sharded logits."""
    logits = logits.float()
    shift_labels = shifted_targets(labels, ignore_index, shift_labels).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = vocab_parallel_cross_entropy(logits, shift_labels, tp_group, vocab_start, ignore_index, reduction,
                                        vocab_size=vocab_size)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def shifted_targets(labels: Tensor, ignore_index: int, shift_labels: Tensor | None) -> Tensor:
    """The label each position predicts (the next token; ignore_index after the last), as ForCausalLMLoss has it."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:] if shift_labels is None else shift_labels


class TokenShard(NamedTuple):
    """The tokens of the sequence (dim 1) one rank of `group` holds: its contiguous 1/world, or with `zigzag` its two
    chunks of 2 * world (ring attention's layout, ring_layout.shard_zigzag); `of` copies them (differentiable)."""
    group: ProcessGroup
    world: int
    rank: int
    zigzag: bool

    def of(self, x: Tensor) -> Tensor:
        """This rank's tokens of the full-sequence `x`."""
        if self.zigzag:
            return shard_zigzag(x, self.world, self.rank, dim=1)
        # a copy: a contiguous chunk (batch 1) is a view that would keep the whole tensor's storage alive for backward
        return x.chunk(self.world, dim=1)[self.rank].clone(memory_format=torch.contiguous_format)


def causal_lm_loss_on_tokens(
    logits: Tensor,
    labels: Tensor,
    tokens: TokenShard,
    token_losses: Callable[[Tensor, Tensor], Tensor],
    vocab_size: int,
    ignore_index: int = -100,
    num_items_in_batch: Tensor | int | None = None,
    shift_labels: Tensor | None = None,
) -> Tensor:
    """ForCausalLMLoss of the whole sequence from this rank's `logits` (batch, its tokens, vocab or vocab shard) and
    the full `labels`: labels are shifted on the full sequence (a shard's last token predicts the next shard's
    first), each rank sums its tokens' losses (`token_losses(logits, targets)`, per token, 0 where ignored) over the
    items of the whole batch (`num_items_in_batch`, else the non-ignored targets of every rank), and the sum over the
    group is the loss. Labels outside the vocabulary raise on every rank (each checks the full labels) before the
    sum's collective. Its backward is the identity into each rank's part: every rank backpropagates the same loss,
    so each rank's logits get exactly one process's gradient of their tokens."""
    targets = shifted_targets(labels, ignore_index, shift_labels).to(logits.device)
    check_targets(targets, ignore_index, vocab_size)
    count = (targets != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(count):
        count = count.to(logits.device)
    mine = token_losses(logits.float(), tokens.of(targets)).sum() / count
    return reduce_from_tp(mine, tokens.group)
