"""One training (or evaluation) step on this rank: its actions of the schedule, run in order.

Transfers go through the P2P layer (one at a time with the "p2p" transport, paired with the "broadcast" one); a
forward of virtual stage s calls this rank's chunk `layout.chunk_of(s)` as `chunk(**micro_batch, **received)`; the
last virtual stage applies `criterion(outputs, micro_batch)`. Results pass to the neighbouring virtual stage locally
when this rank holds it, else through the SEND action that the schedule placed after the compute. The gradient
action named by the rank's REDUCE_GRAD launches the data-parallel reduction (the model's gradient hooks, bucket by
bucket, overlapping that backward); REDUCE_GRAD waits for it.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch
from torch import Tensor

from .actions import (COMM, REDUCE_GRAD, B, I, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, ActionKind, Schedule,
                      peer_stage)
from .nested import detached, grad_pairs, handed_off, input_grads
from .p2p import BACKWARD, FORWARD, PipelineP2PCommunication, Recv, Send
from .split_backward import WeightGradStore, deferring
from .stage_manager import PipelineStageManager

__all__ = ["GradReducer", "LossWeights", "MicroBatch", "StepOptions", "StepRun"]

Chunk = Callable[..., Any]  # one model chunk of this rank: `chunk(**micro_batch, **received)` -> its output
# one microbatch: the keyword arguments of a chunk (a user model's: tensors split along dim 0, other values shared)
MicroBatch = Dict[str, Any]
Span = Callable[[str, int], ContextManager[None]]  # (kind, microbatch) -> a traced span (pipeline/trace.py)
_Key = Tuple[int, int]  # (virtual stage, microbatch)


class GradReducer(Protocol):
    """The model's data-parallel gradient reduction, as the schedule's actions drive it."""

    def launching(self, launch: bool) -> ContextManager[None]:
        """A gradient action during which the gradient hooks launch the reduction (`launch`) or hold it."""

    def reduce_grad(self) -> None:
        """REDUCE_GRAD: finish the reduction (`p.grad` final), unless the user accumulates (booster.no_sync)."""


class LossWeights(NamedTuple):
    """Per microbatch: the factor of its loss in backward, and its weight in the step's reported loss."""
    scales: Sequence[float]
    weights: Sequence[float]


class StepOptions(NamedTuple):
    """What a step does besides running its microbatches.

    Args:
        return_loss: broadcast the step's loss to every stage.
        return_outputs: merge the last stage's outputs.
        loss_weights: None: every microbatch loss weighs 1/m.
        loss_backward: runs the last stage's backward of a (scaled) microbatch loss (e.g. the optimizer's, for loss
            scaling); None: `loss.backward()`.
        reducer: the model's data-parallel gradient reduction, run by the REDUCE_GRAD action; None: no reduction.
    """
    return_loss: bool = False
    return_outputs: bool = False
    loss_weights: Optional[LossWeights] = None
    loss_backward: Optional[Callable[[Tensor], None]] = None
    reducer: Optional[GradReducer] = None


class StepRun:
    """One step on this rank: what it keeps between actions, keyed by (virtual stage, microbatch)."""

    def __init__(self, chunks: Sequence[Chunk], microbatches: Sequence[MicroBatch], criterion: Optional[Callable],
                 options: StepOptions, stage_manager: PipelineStageManager, p2p: PipelineP2PCommunication,
                 span: Span) -> None:
        self.chunks, self.microbatches, self.criterion, self.options = chunks, microbatches, criterion, options
        self.stage_manager, self.layout, self.p2p, self.span = stage_manager, stage_manager.layout, p2p, span
        m = len(microbatches)
        self.weights = options.loss_weights or LossWeights([1.0 / m] * m, [1.0 / m] * m)
        self.loss = torch.zeros((), device=p2p.device)
        self.outputs: Dict[int, object] = {}
        self.fwd_in: Dict[_Key, Any] = {}   # inputs of forwards (received or handed over)
        self.bwd_in: Dict[_Key, object] = {}  # gradients of outputs (received or handed over)
        self.outbox: Dict[Action, object] = {}  # results waiting for their SEND action
        self.saved: Dict[_Key, Tuple[Any, Any]] = {}  # (input, output) until the backward is done
        self.split: frozenset = frozenset()  # this rank's W actions: their forwards' backward is split into I and W
        self.weight_work: Dict[_Key, WeightGradStore] = {}  # what each such W will compute
        self.durations: Optional[Dict[Tuple[ActionKind, int], List[float]]] = None  # measured compute
        self.peak_inflight = 0  # (virtual stage, microbatch) activations alive at once

    def run(self, schedule: Schedule, measure: bool) -> None:
        """Run this rank's actions of `schedule`; with `measure`, time its compute into `durations`."""
        actions = schedule.actions[self.stage_manager.stage]
        self.split = frozenset(a for a in actions if a.kind == W)
        self.durations = {} if measure else None
        reducer = self.options.reducer
        launcher = _launcher(actions) if reducer is not None else None
        batch: List[Action] = []
        for action in actions:
            if action.kind in COMM:
                batch.append(action)
                if self.p2p.transport == "p2p":  # one transfer at a time; "broadcast" pairs them (1f1b)
                    batch = self._communicate(batch)
                continue
            batch = self._communicate(batch)
            if action.kind == REDUCE_GRAD:
                if reducer is not None:
                    reducer.reduce_grad()
                continue
            with reducer.launching(action == launcher) if reducer is not None and action.kind in (B, I, W) \
                    else contextlib.nullcontext():
                if measure:
                    self._timed(action)
                else:
                    self._compute(action)
        self._communicate(batch)
        self.p2p.flush()

    # -- transfers -----------------------------------------------------------------------------------------
    def _communicate(self, batch: List[Action]) -> List[Action]:
        """Run the transfers of `batch` together; returns an empty batch."""
        if not batch:
            return batch
        peer = lambda a: self.stage_manager.stage_ranks[self.layout.rank_of(peer_stage(a))]  # noqa: E731
        edge = lambda a: min(a.stage, peer_stage(a))  # noqa: E731  (a channel: edges may differ in structure)
        sends = [Send(peer(a), FORWARD if a.kind == SEND_F else BACKWARD, self.outbox.pop(a), edge(a))
                 for a in batch if a.kind in (SEND_F, SEND_B)]
        recvs = [a for a in batch if a.kind in (RECV_F, RECV_B)]
        kind = "send+recv" if sends and recvs else "send" if sends else "recv"
        with self.span(kind, -1):
            got = self.p2p.exchange(sends, [Recv(peer(a), FORWARD if a.kind == RECV_F else BACKWARD, edge(a))
                                            for a in recvs])
        for a, obj in zip(recvs, got):
            (self.fwd_in if a.kind == RECV_F else self.bwd_in)[(a.stage, a.microbatch)] = obj
        return []

    def _pass_on(self, stage: int, microbatch: int, obj: object, forward: bool) -> None:
        """Give a result to the neighbouring virtual stage: locally when this rank holds it, else to its SEND."""
        target = stage + 1 if forward else stage - 1
        if self.layout.rank_of(target) == self.layout.rank_of(stage):
            (self.fwd_in if forward else self.bwd_in)[(target, microbatch)] = handed_off(obj) if forward else obj
        else:
            self.outbox[Action(SEND_F if forward else SEND_B, stage, microbatch)] = obj

    # -- compute -------------------------------------------------------------------------------------------
    def _timed(self, action: Action) -> None:
        """`_compute`, its seconds recorded in `durations` (on an accelerator, queued work is waited for)."""
        device = self.p2p.device
        sync = torch.accelerator.synchronize if device.type != "cpu" else lambda _: None
        sync(device)
        start = time.perf_counter()
        self._compute(action)
        sync(device)
        self.durations.setdefault((action.kind, action.stage), []).append(time.perf_counter() - start)

    def _compute(self, action: Action) -> None:
        key, i = (action.stage, action.microbatch), action.microbatch
        if action.kind == W:
            with self.span("backward_weight", i):
                self.weight_work.pop(key).run()
            del self.saved[key]
        elif action.kind in (B, I):
            self._backward(action)
        else:
            self._forward(action)

    def _forward(self, action: Action) -> None:
        stage, i = action.stage, action.microbatch
        last = stage == self.layout.num_stages - 1
        input_obj = None if stage == 0 else self.fwd_in.pop((stage, i))
        store = None
        if torch.is_grad_enabled() and Action(W, stage, i) in self.split:  # its backward comes as I, then W
            store = self.weight_work[(stage, i)] = WeightGradStore()
        with self.span("forward", i), deferring(store):
            output = self.chunks[self.layout.chunk_of(stage)](**self.microbatches[i], **(input_obj or {}))
            if last:
                output = self._loss(output, i)
        if torch.is_grad_enabled():
            self.saved[(stage, i)] = (input_obj, output)
            self.peak_inflight = max(self.peak_inflight, len(self.saved))
        if not last:
            self._pass_on(stage, i, output, forward=True)

    def _loss(self, output: object, i: int) -> Optional[Tensor]:
        """The last virtual stage: microbatch i's (scaled) loss, its outputs kept if asked for."""
        micro_batch = self.microbatches[i]
        if self.options.return_outputs:
            self.outputs[i] = detached(output)
        if self.criterion is None:
            return None
        loss = self.criterion(output, micro_batch)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            raise _not_a_loss(loss)
        self.loss += loss.detach() * self.weights.weights[i]
        return loss * self.weights.scales[i]

    def _backward(self, action: Action) -> None:
        """B, or I: B whose linear layers left their weight gradients to W (the forward bound them to a store)."""
        stage, i = action.stage, action.microbatch
        input_obj, output = self.saved[(stage, i)] if action.kind == I else self.saved.pop((stage, i))
        with self.span("backward" if action.kind == B else "backward_input", i):
            if stage == self.layout.num_stages - 1:  # output is the (scaled) loss
                (self.options.loss_backward or Tensor.backward)(output)
            else:
                tensors, grads = grad_pairs(output, self.bwd_in.pop((stage, i)))
                if tensors:
                    torch.autograd.backward(tensors, grad_tensors=grads)
        if stage > 0:
            self._pass_on(stage, i, input_grads(input_obj), forward=False)


def _not_a_loss(value: object) -> TypeError:
    """The error for a criterion that returned something other than a scalar tensor."""
    what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)[:80]
    hint = " (a model's own `outputs.loss` is None when the batch has no labels)" if value is None else \
        ": reduce it in the criterion, e.g. with .mean()" if isinstance(value, Tensor) else ""
    return TypeError(f"criterion(outputs, micro_batch) must return the microbatch's loss as a scalar tensor; it "
                     f"returned {what}{hint}.")


def _launcher(actions: Sequence[Action]) -> Optional[Action]:
    """The gradient action whose backward launches the reduction: the one the rank's REDUCE_GRAD names."""
    reduction = next((a for a in actions if a.kind == REDUCE_GRAD), None)
    if reduction is None:
        return None
    return next(a for a in reversed(actions) if a.kind in (B, W) and a.stage == reduction.stage
                and a.microbatch == reduction.microbatch)
