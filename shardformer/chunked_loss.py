"""The model's causal-LM loss in chunks of tokens, so that a training forward never holds the full logits
(`ShardConfig.chunked_loss`, on by default; layer/linear_cross_entropy.py computes it).

Where a model's loss is transformers' causal-LM loss (`computes_causal_lm_loss`) and its LM head is an `nn.Linear`
(or our vocab-parallel `ColumnParallelLinear`), a training forward given `labels` runs the model's own forward with
three hooks and its `loss_function` wrapped; nothing of the forward is copied:
- the head's forward pre-hook records the head's input (the hidden states, this rank's tokens where sequence
  parallelism keeps the split through the head: sequence_loss.py, whose hooks run first) and the parameters it
  reads, and hands the head zero tokens, so it computes nothing;
- the head's forward hook returns a probe in place of the logits: a few known values per token. What the model's
  forward does to its logits before the loss (Cohere's scale, Gemma 2's soft-capping) it does to the probe;
- the wrapped `loss_function` receives the probe, recognises what was done to it (nothing, a constant scale,
  `config.final_logit_softcapping`; anything else is refused with a clear error) and computes the loss of the
  recorded hidden states chunk by chunk: labels shifted as ForCausalLMLoss does (or `shift_labels`), `ignore_index`,
  the mean over the batch's targets or the sum over `num_items_in_batch`; vocab-parallel over tp, summed over the
  sp group where the tokens are split;
- the model's forward hook returns its output without `logits` (None): they were never computed.
Eval mode, no labels, or a caller that asks for outputs (`execute_pipeline(..., return_outputs=True)`, which runs
under `ChunkedLoss.full_logits()`) get the full logits and the loss the model had before.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional

import torch
from torch import Tensor, nn

from .tensor.apply_styles import computes_causal_lm_loss
from .layer.comm import copy_to_tp, reduce_from_tp
from .layer.linear import ColumnParallelLinear
from .layer.linear_cross_entropy import LogitTransform, VocabShard, linear_cross_entropy_sum
from .layer.loss import check_targets, shifted_targets
from .sequence.loss import HeadOnShard, labels_argument
from .stage.forward import Released

__all__ = ["ChunkedLoss", "check_chunk_size", "use_chunked_loss"]

PROBE = (1.0, 4.0, -16.0, 64.0)  # powers of two: a scale applied to them is read back exactly


class _HeadCall(NamedTuple):
    """What the head was called with in this forward: its input, its parameters as it read them, the probe."""
    hidden: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    probe: Tensor


def _without_logits(output: object) -> object:
    """The model's output with `logits` None (a ModelOutput rebuilt without them; a tuple keeps its positions)."""
    if isinstance(output, dict) and "logits" in output:
        return type(output)(**{k: v for k, v in output.items() if k != "logits"})
    if isinstance(output, tuple) and len(output) > 1:
        return (output[0], None, *output[2:])
    return output


class ChunkedLoss:
    """The hooks and the loss of one model (see the module docstring)."""

    def __init__(self, model: nn.Module, head: nn.Module, vocab: VocabShard, chunk: Optional[int],
                 sequence_head: Optional[HeadOnShard], compiled: bool = False) -> None:
        self.model_name = type(model).__name__
        self.vocab, self.chunk, self.sequence_head, self.compiled = vocab, chunk, sequence_head, compiled
        self.softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        self.enabled = True
        self.active = False           # this forward computes the loss in chunks
        self.call: Optional[_HeadCall] = None
        model.register_forward_pre_hook(self._begin, with_kwargs=True)
        model.register_forward_hook(self._end, always_call=True)
        head.register_forward_pre_hook(self._enter)
        head.register_forward_hook(self._leave, prepend=True)  # hooks of the user's then act on the probe
        model.loss_function = _ChunkedLossFunction(model.loss_function, self)

    @contextlib.contextmanager
    def full_logits(self) -> Iterator[None]:
        """Forwards inside compute the full logits (a caller that asks for the outputs)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def _begin(self, model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> None:
        self.active = self.enabled and model.training and labels_argument(model, args, kwargs) is not None
        self.call = None

    def _end(self, model: nn.Module, args: tuple, output: object) -> object:
        called, self.call, self.active = self.call, None, False
        return _without_logits(output) if called is not None and output is not None else None

    def _enter(self, head: nn.Module, args: tuple) -> Optional[tuple]:
        if not self.active or not args:
            return None
        if self.call is not None:
            raise RuntimeError(f"{self.model_name}'s forward calls its LM head twice; the chunked loss computes the "
                               f"loss of one call: pass chunked_loss=False to the plugin (ShardConfig).")
        hidden = args[0]
        probe = torch.tensor(PROBE, device=hidden.device).repeat(*hidden.shape[:-1], 1)
        self.call = _HeadCall(hidden, head.weight, head.bias, probe)
        return (hidden[..., :0, :], *args[1:])  # no tokens: the head computes nothing

    def _leave(self, head: nn.Module, args: tuple, output: object) -> Optional[Tensor]:
        return self.call.probe if self.active and self.call is not None else None

    def transform(self, received: Tensor, probe: Tensor) -> LogitTransform:
        """What the model did to the probe: nothing, `config.final_logit_softcapping`, or a constant scale."""
        candidates = [LogitTransform()]
        if self.softcap is not None:
            candidates.append(LogitTransform(softcap=float(self.softcap)))
        if received.shape == probe.shape and received.numel():
            candidates.append(LogitTransform(scale=float(received.reshape(-1)[0]) / PROBE[0]))
        for candidate in candidates:
            if received is probe or (received.shape == probe.shape and
                                     torch.equal(received.float(), candidate.apply(probe)[0])):
                return candidate
        raise NotImplementedError(
            f"{self.model_name}'s forward changes its LM head's output before the loss in a way the chunked loss "
            f"does not reproduce (it follows a constant scale and config.final_logit_softcapping): pass "
            f"chunked_loss=False to the plugin (ShardConfig) to compute the loss on the full logits.")

    def loss(self, received: Tensor, labels: Tensor, vocab_size: int, ignore_index: int,
             num_items_in_batch: Tensor | int | None, shift_labels: Optional[Tensor]) -> Tensor:
        """The causal-LM loss of the recorded head call (one process's, also with the tokens split over sp)."""
        call = self.call
        transform = self.transform(received, call.probe)
        targets = shifted_targets(labels, ignore_index, shift_labels).to(call.hidden.device)
        check_targets(targets, ignore_index, vocab_size)  # every rank alike, before the loss's collectives
        count = (targets != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
        split = self.sequence_head if self.sequence_head is not None and self.sequence_head.active else None
        if split is not None:
            targets = split.tokens.of(targets)
        if targets.shape != call.hidden.shape[:-1]:
            raise ValueError(f"The LM head ran on {tuple(call.hidden.shape[:-1])} positions but the labels give "
                             f"{tuple(targets.shape)}: with labels, call the model without logits_to_keep (every "
                             f"position has a loss), or pass chunked_loss=False to the plugin.")
        hidden = call.hidden
        if self.vocab.group is not None:  # its gradient: the sum of every vocab shard's part
            hidden = copy_to_tp(hidden, self.vocab.group)
        total = linear_cross_entropy_sum(hidden.reshape(-1, hidden.size(-1)), call.weight, call.bias,
                                         targets.reshape(-1), self.vocab, transform, self.chunk, ignore_index,
                                         self.compiled)
        loss = total / (count.to(total.device) if torch.is_tensor(count) else count)
        return reduce_from_tp(loss, split.tokens.group) if split is not None else loss


class _ChunkedLossFunction:
    """`model.loss_function`: the chunked loss on the probe of this forward's head call, the model's loss function
    before (`own`) otherwise."""

    def __init__(self, own: Callable[..., Tensor], state: ChunkedLoss) -> None:
        self.own, self.state = own, state

    def __call__(self, logits: Tensor, labels: Tensor, vocab_size: int, num_items_in_batch: Tensor | int | None = None,
                 ignore_index: int = -100, shift_labels: Optional[Tensor] = None, **kwargs) -> Tensor:
        if not self.state.active or self.state.call is None:
            return self.own(logits, labels, vocab_size=vocab_size, num_items_in_batch=num_items_in_batch,
                            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        return self.state.loss(logits, labels, vocab_size, ignore_index, num_items_in_batch, shift_labels)


def _vocab_of(head: nn.Module) -> Optional[VocabShard]:
    """The vocabulary columns of a head the chunked loss can compute from its weight; None for another head."""
    if isinstance(head, ColumnParallelLinear):
        if head.is_conv1d or head.n_fused != 1:
            return None
        return VocabShard(head.output_start, head.full_out_features, head.tp_group)
    if isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward:
        return VocabShard(0, head.out_features)
    return None


def _held_head(model: nn.Module) -> Optional[nn.Module]:
    """The model's LM head; None where it has none, or a module on its path is released on this stage (BERT's
    `cls.predictions.decoder` with `cls` released)."""
    try:
        return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    except AttributeError:
        return None


def check_chunk_size(chunk: Optional[int]) -> None:
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"loss_chunk_size={chunk!r}: give a positive number of tokens per chunk, or None to let "
                         f"the chunked loss choose.")


def use_chunked_loss(model: nn.Module, chunk: Optional[int], sequence_head: Optional[HeadOnShard],
                     compiled: bool = False) -> Optional[ChunkedLoss]:
    """Compute `model`'s causal-LM loss in chunks in training (see the module docstring) where this stage holds the
    LM head, an nn.Linear or ColumnParallelLinear, and the loss is transformers' causal-LM loss; None otherwise.
    `compiled`: each chunk's arithmetic runs compiled (linear_cross_entropy_sum)."""
    check_chunk_size(chunk)
    if not computes_causal_lm_loss(model):
        return None
    head = _held_head(model)
    if head is None or isinstance(head, Released):
        return None
    vocab = _vocab_of(head)
    return None if vocab is None else ChunkedLoss(model, head, vocab, chunk, sequence_head, compiled)
