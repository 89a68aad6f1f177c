"""The 1F1B pipeline schedule: warm-up forwards, steady one-forward-one-backward, cool-down backwards.

Stage s runs `min(p - s - 1, m)` warm-up forwards, so at most `p - s` microbatches of activations are alive on it
(GPipe keeps all `m`). The model is called as `model(**micro_batch, **received)`; the last stage applies
`criterion(outputs, micro_batch)` and the mean over microbatches is the step's loss, broadcast to every stage.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

import torch
import torch.distributed as dist

from .p2p import PipelineP2PCommunication
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


def _set_grad_sync(model: Any, enabled: bool) -> None:
    """Models that reduce gradients during backward (data parallel) do it only in the step's last backward."""
    if hasattr(model, "require_grad_sync"):
        model.require_grad_sync = enabled


class OneForwardOneBackwardSchedule:
    """Runs one training (or evaluation) step of `num_microbatches` microbatches over the pipeline."""

    def __init__(self, stage_manager: PipelineStageManager, p2p: PipelineP2PCommunication,
                 num_microbatches: Optional[int] = None, microbatch_size: Optional[int] = None) -> None:
        if (num_microbatches is None) == (microbatch_size is None):
            raise ValueError("Give exactly one of num_microbatches or microbatch_size to the 1F1B schedule.")
        if num_microbatches is not None and num_microbatches < stage_manager.num_stages:
            raise ValueError(f"1F1B needs num_microbatches >= pp_size to fill the pipeline; got num_microbatches="
                             f"{num_microbatches} with pp_size={stage_manager.num_stages}.")
        self.stage_manager = stage_manager
        self.p2p = p2p
        self.num_microbatches = num_microbatches
        self.microbatch_size = microbatch_size
        self.peak_inflight_microbatches = 0  # activations alive at once on this stage, for the memory promise
        self.tracer: Optional[ScheduleTracer] = None  # set to record a timeline (pipeline/trace.py)
        # microbatches -> (scale of each microbatch loss in backward, its weight in the reported loss); default:
        # 1/m for both. Lets the plugin weigh microbatches by their number of loss tokens.
        self.loss_scales_fn: Optional[Callable[[List[Dict[str, Any]]], tuple]] = None

    def _span(self, kind: str, microbatch: int = -1):
        return _NO_SPAN if self.tracer is None else self.tracer.span(kind, microbatch)

    def _comm(self, kind: str, fn: Callable, *args: Any) -> Any:
        with self._span(kind):
            return fn(*args)

    # -- one microbatch -----------------------------------------------------------------------------------
    def _forward(self, model: Callable, micro_batch: Dict[str, Any], input_obj: Any, criterion: Optional[Callable],
                 state: Dict[str, Any]) -> Any:
        with self._span("forward", state["forwards"]):
            state["forwards"] += 1
            return self._forward_step(model, micro_batch, input_obj, criterion, state)

    def _forward_step(self, model, micro_batch, input_obj, criterion, state) -> Any:
        output = model(**micro_batch, **(input_obj or {}))
        if not self.stage_manager.is_last_stage():
            return output
        if state["return_outputs"]:
            state["outputs"].append(_detach(output))
        if criterion is None:
            return None
        loss = criterion(output, micro_batch)
        index = state["forwards"] - 1
        state["loss"] += loss.detach() * state["report_weights"][index]
        return loss * state["backward_scales"][index]

    def _backward(self, optimizer: Any, input_obj: Any, output_obj: Any, output_grad: Any, state: Dict[str, Any]) -> Any:
        with self._span("backward", state["backwards"]):
            state["backwards"] += 1
            return self._backward_step(optimizer, input_obj, output_obj, output_grad)

    @staticmethod
    def _backward_step(optimizer: Any, input_obj: Any, output_obj: Any, output_grad: Any) -> Any:
        if output_grad is None:  # last stage: output_obj is the (scaled) loss
            if hasattr(optimizer, "backward"):
                optimizer.backward(output_obj)
            else:
                output_obj.backward()
        else:
            tensors, grads = zip(*_grad_pairs(output_obj, output_grad)) if output_obj is not None else ((), ())
            if tensors:
                torch.autograd.backward(list(tensors), grad_tensors=list(grads))
        return _input_grads(input_obj)

    # -- a step ---------------------------------------------------------------------------------------------
    def forward_backward_step(self, model: Callable, data_iter: Iterator, criterion: Optional[Callable],
                              optimizer: Any = None, return_loss: bool = False,
                              return_outputs: bool = False) -> Dict[str, Any]:
        microbatches = split_batch(next(data_iter), self.num_microbatches, self.microbatch_size)
        m, sm, p2p = len(microbatches), self.stage_manager, self.p2p
        if m < sm.num_stages:
            raise ValueError(f"1F1B needs at least pp_size={sm.num_stages} microbatches, got {m}.")
        state = {"loss": torch.zeros((), device=p2p.device), "outputs": [], "return_outputs": return_outputs,
                 "num_microbatches": m, "forwards": 0, "backwards": 0, "model": model}
        if self.loss_scales_fn is None:  # the step's loss is the mean of the microbatch losses
            state["backward_scales"] = state["report_weights"] = [1.0 / m] * m
        else:
            state["backward_scales"], state["report_weights"] = self.loss_scales_fn(microbatches)
        if self.tracer is not None:
            self.tracer.start_step(m, sm.pp_group)
        p2p.new_step()
        first, last = sm.is_first_stage(), sm.is_last_stage()
        next_mb = iter(microbatches)

        if not torch.is_grad_enabled():  # evaluation: forwards only
            for mb in next_mb:
                input_obj = None if first else self._comm("recv", p2p.recv_forward)
                output = self._forward(model, mb, input_obj, criterion, state)
                if not last:
                    self._comm("send", p2p.send_forward, output)
            return self._finish(state, criterion is not None and return_loss)

        num_warmup = min(sm.num_stages - sm.stage - 1, m)
        num_steady = m - num_warmup
        input_objs: List[Any] = []
        output_objs: List[Any] = []
        self.peak_inflight_microbatches = 0

        def run_forward(input_obj):
            output = self._forward(model, next(next_mb), input_obj, criterion, state)
            input_objs.append(input_obj)
            output_objs.append(output)
            self.peak_inflight_microbatches = max(self.peak_inflight_microbatches, len(output_objs))
            return output

        for _ in range(num_warmup):
            output = run_forward(None if first else self._comm("recv", p2p.recv_forward))
            self._comm("send", p2p.send_forward, output)

        input_obj = None if first or num_steady == 0 else self._comm("recv", p2p.recv_forward)
        for i in range(num_steady):
            output = run_forward(input_obj)
            output_grad = None if last else self._comm("send+recv", p2p.send_forward_recv_backward, output)
            _set_grad_sync(model, state["backwards"] == m - 1)
            input_grad = self._backward(optimizer, input_objs.pop(0), output_objs.pop(0), output_grad, state)
            if i == num_steady - 1:
                if not first:
                    self._comm("send", p2p.send_backward, input_grad)
            elif first:
                input_obj = None
            else:
                input_obj = self._comm("send+recv", p2p.send_backward_recv_forward, input_grad)

        for _ in range(num_warmup):
            output_grad = self._comm("recv", p2p.recv_backward)
            _set_grad_sync(model, state["backwards"] == m - 1)
            input_grad = self._backward(optimizer, input_objs.pop(0), output_objs.pop(0), output_grad, state)
            if not first:
                self._comm("send", p2p.send_backward, input_grad)
        return self._finish(state, return_loss)

    def _finish(self, state: Dict[str, Any], return_loss: bool) -> Dict[str, Any]:
        self.p2p.flush()
        _set_grad_sync(state["model"], True)
        loss = None
        if return_loss:
            loss = state["loss"]
            if self.stage_manager.num_stages > 1:  # the loss lives on the last stage; give it to every stage
                dist.broadcast(loss, src=self.stage_manager.last_rank, group=self.stage_manager.pp_group)
        outputs = merge_outputs(state["outputs"]) if state["outputs"] else None
        return {"loss": loss, "outputs": outputs}
