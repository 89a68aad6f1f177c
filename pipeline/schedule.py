"""The pipeline runtime: runs one rank's list of schedule actions (pipeline/actions.py) for a training or
evaluation step. Which actions, in which order, is decided by a generator in pipeline/schedules.py
("1f1b", "interleaved", "zbv", "dualpipev"); this file knows no schedule.

The model is called as `model(**micro_batch, **received)` with `stage_manager.model_chunk_id` set to the chunk of
the action's virtual stage; the last virtual stage applies `criterion(outputs, micro_batch)` and the mean over
microbatches (or the `loss_scales_fn` weighting) is the step's loss, broadcast to every stage.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from .actions import B, COMM, F, I, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, peer_stage
from .p2p import BACKWARD, FORWARD, PipelineP2PCommunication
from .refine import agree_on_refined
from .schedules import V_STYLES, Schedule, forward_only, make_schedule
from .simulator import simulate
from .split_backward import WeightGradStore, deferring
from .stage_manager import PipelineStageManager
from .trace import ScheduleTracer

_NO_SPAN = contextlib.nullcontext()


def split_batch(batch: Mapping[str, Any], num_microbatches: Optional[int], microbatch_size: Optional[int]) -> List[Dict[str, Any]]:
    """Split every tensor of a batch dict along dim 0; non-tensor values are given to every microbatch."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"A pipeline batch must be a dict of tensors (e.g. input_ids, attention_mask, labels), "
                        f"got {type(batch).__name__}.")
    sizes = {k: v.shape[0] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not sizes:
        raise ValueError("The batch has no tensor to split into microbatches.")
    batch_size = next(iter(sizes.values()))
    if any(s != batch_size for s in sizes.values()):
        raise ValueError(f"All tensors of a batch must share dim 0 (the batch size); got {sizes}.")
    if num_microbatches is None:
        if batch_size % microbatch_size:
            raise ValueError(f"Batch size {batch_size} is not divisible by microbatch_size={microbatch_size}.")
        num_microbatches = batch_size // microbatch_size
    if batch_size % num_microbatches:
        raise ValueError(f"Batch size {batch_size} is not divisible into num_microbatches={num_microbatches}; "
                         f"use a batch size that is a multiple of {num_microbatches}.")
    size = batch_size // num_microbatches
    return [{k: v[i * size:(i + 1) * size] if k in sizes else v for k, v in batch.items()}
            for i in range(num_microbatches)]


def _grad_pairs(output_obj: Any, output_grad: Any):
    """Yield (tensor, grad) pairs from two structures of the same shape, skipping missing gradients."""
    if isinstance(output_obj, torch.Tensor):
        if output_grad is not None and output_obj.requires_grad:
            yield output_obj, output_grad
    elif isinstance(output_obj, Mapping):
        for k, v in output_obj.items():
            yield from _grad_pairs(v, output_grad.get(k) if output_grad is not None else None)
    elif isinstance(output_obj, (list, tuple)):
        for i, v in enumerate(output_obj):
            yield from _grad_pairs(v, output_grad[i] if output_grad is not None else None)


def _input_grads(input_obj: Any) -> Any:
    if isinstance(input_obj, torch.Tensor):
        return input_obj.grad if input_obj.requires_grad else None
    if isinstance(input_obj, Mapping):
        return {k: _input_grads(v) for k, v in input_obj.items()}
    if isinstance(input_obj, (list, tuple)):
        return [_input_grads(v) for v in input_obj]
    return None


def merge_outputs(outputs: List[Any]) -> Any:
    """Concatenate per-microbatch outputs (dicts / ModelOutputs / tensors) along dim 0."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, dim=0) if first.dim() > 0 else torch.stack(outputs)
    if isinstance(first, Mapping):
        merged = {k: merge_outputs([o[k] for o in outputs]) for k, v in first.items() if v is not None}
        return type(first)(**merged) if hasattr(first, "to_tuple") else merged
    if isinstance(first, (list, tuple)):
        return type(first)(merge_outputs(list(x)) for x in zip(*outputs))
    return first


def _detach(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, Mapping):
        detached = {k: _detach(v) for k, v in obj.items()}
        return type(obj)(**detached) if hasattr(obj, "to_tuple") else detached
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detach(v) for v in obj)
    return obj


def _handoff(obj: Any) -> Any:
    """An output passed to the next virtual stage on the same rank: a new leaf, as if it had been received."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().requires_grad_(obj.requires_grad)
    if isinstance(obj, Mapping):
        return {k: _handoff(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_handoff(v) for v in obj)
    return obj


class _Step:
    """What one step keeps between actions, keyed by (virtual stage, microbatch)."""

    def __init__(self, model, criterion, optimizer, microbatches, scales, weights, return_outputs, device) -> None:
        self.model, self.criterion, self.optimizer = model, criterion, optimizer
        self.microbatches, self.scales, self.weights = microbatches, scales, weights
        self.return_outputs = return_outputs
        self.loss = torch.zeros((), device=device)
        self.outputs: Dict[int, Any] = {}
        self.fwd_in: Dict[Tuple[int, int], Any] = {}   # inputs of forwards (received or handed over)
        self.bwd_in: Dict[Tuple[int, int], Any] = {}   # gradients of outputs (received or handed over)
        self.outbox: Dict[Action, Any] = {}            # results waiting for their SEND action
        self.saved: Dict[Tuple[int, int], Tuple[Any, Any]] = {}  # (input, output) until the backward is done
        self.split: frozenset = frozenset()  # this rank's W actions: their forwards' backward is split into I and W
        self.weight_work: Dict[Tuple[int, int], WeightGradStore] = {}  # what each such W will compute
        self.durations: Optional[Dict[Tuple[str, int], List[float]]] = None  # measured compute, (kind, stage)


class PipelineSchedule:
    """Runs training (or evaluation) steps of `num_microbatches` microbatches over the pipeline by executing this
    rank's actions of the schedule generated for `style`.

    Args:
        stage_manager: this rank's stage, layout of the virtual stages and pipeline group.
        p2p: transfers between ranks.
        num_microbatches: microbatches per step (or give `microbatch_size`).
        microbatch_size: samples per microbatch.
        style: "1f1b", "interleaved", "zbv" or "dualpipev" (pipeline/schedules.py).
        measured_costs: for the V styles ("zbv", "dualpipev"), time the compute of the first training step with a
            number of microbatches and re-plan the order for those costs (pipeline/refine.py; a collective at the
            end of that step); False keeps the unit-cost order.
    """

    def __init__(self, stage_manager: PipelineStageManager, p2p: PipelineP2PCommunication,
                 num_microbatches: Optional[int] = None, microbatch_size: Optional[int] = None,
                 style: str = "1f1b", measured_costs: bool = False) -> None:
        if (num_microbatches is None) == (microbatch_size is None):
            raise ValueError("Give exactly one of num_microbatches or microbatch_size to the pipeline schedule.")
        if style != "1f1b" and p2p.transport != "p2p":
            raise ValueError(f"pp_style={style!r} needs p2p_transport='p2p' (the broadcast transport's sends wait "
                             f"for the receiver, which only the 1f1b order allows).")
        self.stage_manager, self.p2p, self.style = stage_manager, p2p, style
        self.num_microbatches, self.microbatch_size = num_microbatches, microbatch_size
        self._plans: Dict[int, Tuple[Schedule, float]] = {}
        # numbers of microbatches whose plan is re-planned after their first training step
        self._to_measure = style in V_STYLES and measured_costs
        self._measured: set = set()
        if num_microbatches is not None:
            self.plan(num_microbatches)  # invalid (style, p, m) fails here, before any step
        self.peak_inflight_microbatches = 0  # (virtual stage, microbatch) activations alive at once on this rank
        self.tracer: Optional[ScheduleTracer] = None  # set to record a timeline (pipeline/trace.py)
        # microbatches -> (scale of each microbatch loss in backward, its weight in the reported loss); default:
        # 1/m for both. Lets the plugin weigh microbatches by their number of loss tokens.
        self.loss_scales_fn: Optional[Callable[[List[Dict[str, Any]]], tuple]] = None

    def plan(self, m: int) -> Tuple[Schedule, float]:
        """The schedule for m microbatches and its simulated bubble (the theory the trace compares with): under
        unit costs, or under the measured costs it was re-planned for."""
        if m not in self._plans:
            sm = self.stage_manager
            schedule = make_schedule(self.style, sm.num_stages, sm.num_model_chunks, m)
            self._plans[m] = schedule, simulate(schedule).bubble
        return self._plans[m]

    def use_schedule(self, schedule: Schedule) -> None:
        """Run `schedule` (e.g. one built or refined by hand: pipeline/refine.py) for its number of microbatches;
        it must be the same on every rank. Checked by the simulator first (raises ScheduleError).

        Args:
            schedule: per-rank action lists for this pipeline's layout.
        """
        if schedule.layout != self.stage_manager.layout:
            raise ValueError(f"The schedule is for {schedule.layout}, this pipeline is {self.stage_manager.layout}.")
        self._plans[schedule.num_microbatches] = schedule, simulate(schedule).bubble
        self._measured.add(schedule.num_microbatches)

    def _span(self, kind: str, microbatch: int = -1):
        return _NO_SPAN if self.tracer is None else self.tracer.span(kind, microbatch)

    # -- a step ---------------------------------------------------------------------------------------------
    def forward_backward_step(self, model: Callable, data_iter: Iterator, criterion: Optional[Callable],
                              optimizer: Any = None, return_loss: bool = False,
                              return_outputs: bool = False) -> Dict[str, Any]:
        """One step: forwards and (with grad enabled) backwards of every microbatch; {"loss", "outputs"}.

        Args:
            model: the stage's model, called as `model(**micro_batch, **received)`.
            data_iter: yields the batch (a dict of tensors split along dim 0).
            criterion: `criterion(outputs, micro_batch)` on the last virtual stage.
            optimizer: its `backward(loss)` runs the last stage's full backward when it has one.
            return_loss: broadcast the step's loss to every stage.
            return_outputs: merge the last stage's outputs.
        """
        microbatches = split_batch(next(data_iter), self.num_microbatches, self.microbatch_size)
        m, sm = len(microbatches), self.stage_manager
        schedule, theory = self.plan(m)
        training = torch.is_grad_enabled()
        if not training:
            schedule = forward_only(schedule)
        if self.loss_scales_fn is None:  # the step's loss is the mean of the microbatch losses
            scales = weights = [1.0 / m] * m
        else:
            scales, weights = self.loss_scales_fn(microbatches)
        if self.tracer is not None:
            self.tracer.start_step(m, sm.pp_group, theory)
        self.p2p.new_step()
        st = _Step(model, criterion, optimizer, microbatches, scales, weights, return_outputs, self.p2p.device)
        actions = schedule.actions[sm.stage]
        st.split = frozenset(a for a in actions if a.kind == W)
        measuring = training and self._to_measure and m not in self._measured
        if measuring:
            st.durations = {}
        # data-parallel reduction: launched by gradient hooks in the rank's last gradient action only, and never
        # when the user accumulates gradients (booster.no_sync), whose setting is restored afterwards
        user_sync = getattr(model, "require_grad_sync", None)
        last_grad = max((k for k, a in enumerate(actions) if a.kind in (B, W)), default=-1)
        self.peak_inflight_microbatches = 0
        batch: List[Action] = []
        try:
            for k, action in enumerate(actions):
                if action.kind in COMM:
                    batch.append(action)
                    if self.p2p.transport == "p2p":  # one transfer at a time; "broadcast" pairs them (1f1b)
                        batch = self._communicate(batch, st)
                    continue
                batch = self._communicate(batch, st)
                if user_sync is not None and action.kind in (B, I, W):
                    model.require_grad_sync = user_sync and k == last_grad
                if measuring:
                    self._timed_compute(action, st)
                else:
                    self._compute(action, st)
            self._communicate(batch, st)
            self.p2p.flush()
        finally:
            sm.model_chunk_id = None
            if user_sync is not None:
                model.require_grad_sync = user_sync
        loss = None
        if criterion is not None and return_loss:
            loss = st.loss
            if sm.num_stages > 1:  # the loss lives with the last virtual stage; give it to every stage
                dist.broadcast(loss, src=sm.last_rank, group=sm.pp_group)
        if measuring:  # every rank re-plans from the same measured costs (a collective over all ranks)
            self._plans[m] = agree_on_refined(schedule, st.durations, self.p2p.device)
            self._measured.add(m)
        outputs = merge_outputs([st.outputs[i] for i in sorted(st.outputs)]) if st.outputs else None
        return {"loss": loss, "outputs": outputs}

    # -- transfers -----------------------------------------------------------------------------------------
    def _communicate(self, batch: List[Action], st: _Step) -> List[Action]:
        """Run the transfers of `batch` together; returns an empty batch."""
        if not batch:
            return batch
        sm = self.stage_manager
        peer = lambda a: sm.stage_ranks[sm.layout.rank_of(peer_stage(a))]  # noqa: E731
        sends = [(peer(a), FORWARD if a.kind == SEND_F else BACKWARD, st.outbox.pop(a))
                 for a in batch if a.kind in (SEND_F, SEND_B)]
        recvs = [a for a in batch if a.kind in (RECV_F, RECV_B)]
        kind = "send+recv" if sends and recvs else "send" if sends else "recv"
        with self._span(kind):
            got = self.p2p.exchange(sends, [(peer(a), FORWARD if a.kind == RECV_F else BACKWARD) for a in recvs])
        for a, obj in zip(recvs, got):
            (st.fwd_in if a.kind == RECV_F else st.bwd_in)[(a.stage, a.microbatch)] = obj
        return []

    def _pass_on(self, st: _Step, stage: int, microbatch: int, obj: Any, forward: bool) -> None:
        """Give a result to the neighbouring virtual stage: locally when this rank holds it, else to its SEND."""
        layout = self.stage_manager.layout
        target = stage + 1 if forward else stage - 1
        if layout.rank_of(target) == layout.rank_of(stage):
            (st.fwd_in if forward else st.bwd_in)[(target, microbatch)] = _handoff(obj) if forward else obj
        else:
            st.outbox[Action(SEND_F if forward else SEND_B, stage, microbatch)] = obj

    # -- compute -------------------------------------------------------------------------------------------
    def _timed_compute(self, action: Action, st: _Step) -> None:
        """`_compute`, its seconds recorded in `st.durations` (on an accelerator, queued work is waited for)."""
        device = self.p2p.device
        sync = torch.accelerator.synchronize if device.type != "cpu" else lambda _: None
        sync(device)
        start = time.perf_counter()
        self._compute(action, st)
        sync(device)
        st.durations.setdefault((action.kind, action.stage), []).append(time.perf_counter() - start)

    def _compute(self, action: Action, st: _Step) -> None:
        sm = self.stage_manager
        stage, i = action.stage, action.microbatch
        last = stage == sm.layout.num_stages - 1
        if action.kind == F:
            sm.model_chunk_id = sm.layout.chunk_of(stage)
            input_obj = None if stage == 0 else st.fwd_in.pop((stage, i))
            store = None
            if torch.is_grad_enabled() and Action(W, stage, i) in st.split:  # its backward comes as I, then W
                store = st.weight_work[(stage, i)] = WeightGradStore()
            with self._span("forward", i), deferring(store):
                output = self._forward_step(st, input_obj, i, last)
            if torch.is_grad_enabled():
                st.saved[(stage, i)] = (input_obj, output)
                self.peak_inflight_microbatches = max(self.peak_inflight_microbatches, len(st.saved))
            if not last:
                self._pass_on(st, stage, i, output, forward=True)
            return
        if action.kind == W:
            with self._span("backward_weight", i):
                st.weight_work.pop((stage, i)).run()
            del st.saved[(stage, i)]
            return
        input_obj, output = st.saved[(stage, i)] if action.kind == I else st.saved.pop((stage, i))
        output_grad = None if last else st.bwd_in.pop((stage, i))
        # I is B whose linear layers left their weight gradients to W (the forward bound them to a store)
        with self._span("backward" if action.kind == B else "backward_input", i):
            self._backward_step(st.optimizer, output, output_grad)
        if stage > 0:
            self._pass_on(st, stage, i, _input_grads(input_obj), forward=False)

    def _forward_step(self, st: _Step, input_obj: Any, i: int, last: bool) -> Any:
        micro_batch = st.microbatches[i]
        output = st.model(**micro_batch, **(input_obj or {}))
        if not last:
            return output
        if st.return_outputs:
            st.outputs[i] = _detach(output)
        if st.criterion is None:
            return None
        loss = st.criterion(output, micro_batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise _not_a_loss(loss)
        st.loss += loss.detach() * st.weights[i]
        return loss * st.scales[i]

    @staticmethod
    def _backward_step(optimizer: Any, output_obj: Any, output_grad: Any) -> None:
        if output_grad is None:  # last stage: output_obj is the (scaled) loss
            if hasattr(optimizer, "backward"):
                optimizer.backward(output_obj)
            else:
                output_obj.backward()
            return
        tensors, grads = _split_pairs(output_obj, output_grad)
        if tensors:
            torch.autograd.backward(tensors, grad_tensors=grads)


def _not_a_loss(value: Any) -> TypeError:
    """The error for a criterion that returned something other than a scalar tensor."""
    what = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)[:80]
    hint = " (a model's own `outputs.loss` is None when the batch has no labels)" if value is None else \
        ": reduce it in the criterion, e.g. with .mean()" if isinstance(value, torch.Tensor) else ""
    return TypeError(f"criterion(outputs, micro_batch) must return the microbatch's loss as a scalar tensor; it "
                     f"returned {what}{hint}.")


def _split_pairs(output_obj: Any, output_grad: Any) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    pairs = list(_grad_pairs(output_obj, output_grad)) if output_obj is not None else []
    return [t for t, _ in pairs], [g for _, g in pairs]
