"""Sequence parallelism on the LM head and the model's own causal-LM loss (modes "all_to_all" and "ring_attn",
applied by sequence_parallel.apply_sequence_parallelism).

The span's end gathers the hidden states (the model's code after it, e.g. GPT-2's final view, sees the shapes one
process has). In a training forward that passes `labels` to a model whose loss is transformers' causal-LM loss
(with `parallel_output=True`), the LM head then takes this rank's tokens again (contiguous, or zigzag for
ring_attn) and computes their logits only (vocab-parallel over tp where tp > 1); the gathered hidden states are not
kept for backward. The model's `loss_function` (layer/loss.py causal_lm_loss_on_tokens) shifts the full labels,
takes this rank's targets and sums the group's token losses over the batch's items: one process's loss. The head's
weight (and bias) sees this rank's tokens only: while the head runs, its parameters enter it through `copy_to_tp`
over the sp group, so the gradient of this use is summed over the group while another use of a tied weight (GPT-2's
input embedding, on the full sequence) is not. The model's `logits` are then this rank's tokens (as they are this
rank's vocabulary columns with tp); pipeline outputs (`execute_pipeline(..., return_outputs=True)`) are gathered.
Without labels, in eval mode, with `parallel_output=False` or another loss the head runs on the full sequence.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch.nn.functional as F
from torch import Tensor, nn

from ..tensor.apply_styles import ParallelCausalLMLoss, computes_causal_lm_loss
from ..layer.comm import copy_to_tp
from ..layer.loss import TokenShard, causal_lm_loss_on_tokens
from ..stage.forward import Released

__all__ = ["HeadOnShard", "keep_split_through_head", "labels_argument"]


class HeadOnShard:
    """Whether the running forward runs the head on this rank's tokens (a training forward with labels), and the
    tokens this rank holds. Set by a forward pre-hook of the model, read by the head's hooks and the plugin's merge
    of pipeline outputs."""

    def __init__(self, tokens: TokenShard) -> None:
        self.tokens = tokens
        self.active = False

    def record(self, model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> None:
        self.active = model.training and labels_argument(model, args, kwargs) is not None


def labels_argument(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> object:
    """The `labels` argument of a call of the model (keyword or positional), None when not given."""
    if "labels" in kwargs or not args:
        return kwargs.get("labels")
    names = list(inspect.signature(model.forward).parameters)
    index = names.index("labels") if "labels" in names else len(args)
    return args[index] if index < len(args) else None


def keep_split_through_head(model: nn.Module, tokens: TokenShard, parallel_output: bool) -> Optional[HeadOnShard]:
    """Run the head and loss on this rank's tokens where this stage's model holds the head and computes
    transformers' causal-LM loss; None otherwise (the head runs on the gathered sequence, as before)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not parallel_output or head is None or isinstance(head, Released) or not computes_causal_lm_loss(model):
        return None
    state = HeadOnShard(tokens)
    model.register_forward_pre_hook(state.record, with_kwargs=True)
    on_tokens = _HeadOnTokens(state)
    head.register_forward_pre_hook(on_tokens.enter)
    head.register_forward_hook(on_tokens.leave, prepend=True, always_call=True)
    model.loss_function = _LossOnTokens(model.loss_function, tokens)
    return state


class _HeadOnTokens:
    """The head's forward pre-hook and forward hook: in a forward that keeps the split, the head's input becomes this
    rank's tokens of the gathered sequence and each parameter of the head (and of modules inside it, e.g. adapters)
    is read through `copy_to_tp` over the sp group (identity forward, gradient summed), restored afterwards."""

    def __init__(self, state: HeadOnShard) -> None:
        self.state = state
        self.held: List[Tuple[nn.Module, str, nn.Parameter]] = []

    def enter(self, module: nn.Module, args: tuple) -> Optional[tuple]:
        if not self.state.active or not args:  # (called with keywords: it runs on the full sequence, as before)
            return None
        for owner in module.modules():
            for name, p in list(owner._parameters.items()):
                if p is not None and p.requires_grad:
                    self.held.append((owner, name, p))
                    owner._parameters[name] = copy_to_tp(p, self.state.tokens.group)
        return (self.state.tokens.of(args[0]), *args[1:])

    def leave(self, module: nn.Module, args: tuple, output: object) -> None:
        for owner, name, p in self.held:
            owner._parameters[name] = p
        self.held = []


class _LossOnTokens:
    """`model.loss_function`: on logits of this rank's tokens, the causal-LM loss of the whole sequence
    (causal_lm_loss_on_tokens); on full-sequence logits the model's loss function before (`own`)."""

    def __init__(self, own: Callable[..., Tensor], tokens: TokenShard) -> None:
        self.own, self.tokens = own, tokens

    def __call__(self, logits: Tensor, labels: Tensor, vocab_size: int, ignore_index: int = -100,
                 num_items_in_batch: Tensor | int | None = None, shift_labels: Optional[Tensor] = None,
                 **kwargs) -> Tensor:
        length = (labels if shift_labels is None else shift_labels).shape[-1]
        if logits.shape[1] == length:
            return self.own(logits, labels, vocab_size=vocab_size, ignore_index=ignore_index,
                            num_items_in_batch=num_items_in_batch, shift_labels=shift_labels, **kwargs)
        if isinstance(self.own, ParallelCausalLMLoss) and logits.shape[-1] != vocab_size:  # vocab columns over tp
            token_losses = functools.partial(self.own.token_losses, ignore_index=ignore_index)
        else:
            token_losses = functools.partial(_token_losses, ignore_index=ignore_index)
        return causal_lm_loss_on_tokens(logits, labels, self.tokens, token_losses, vocab_size, ignore_index,
                                        num_items_in_batch, shift_labels)


def _token_losses(logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index, reduction="none")
