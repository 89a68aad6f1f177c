"""Under pipeline parallelism a rank holds one stage of the model: the pipeline schedule calls it, and so may every rank
of the pipeline alike for evaluation.

A call the script makes itself (`model(**batch)`, `model.unwrap()(**batch)`, each forward of
`model.unwrap().generate(...)`) made by every rank (SPMD) runs as one pipelined forward
(shardformer/stage/pipelined_call.py) where it evaluates: under torch.no_grad() or with the model in eval mode (as
`execute_pipeline` tells evaluation from training, without an optimizer). A training call, or one the pipelined
forward cannot run (several chunks per rank, an encoder-decoder or multimodal model, ...), is refused on every rank
alike, before anything runs, by forward pre-hooks on the boosted model and on the transformers model inside it.
`execute_pipeline` runs its step inside `running_step(stage_manager)`, whose calls the hooks let through. The
schedule calls the model through `chunk_calls`: one callable per model chunk (virtual stage) this rank holds.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from pipeline import PipelineStageManager
from pipeline.step import Chunk
from shardformer.stage.forward import CHUNK_ARGUMENT
from shardformer.stage.pipelined_call import CACHE_NAMES, PipelinedCall

from ..guards.failure import FailureGuard

__all__ = ["PipelineCallError", "chunk_calls", "in_schedule", "route_direct_calls", "running_step"]

# the pipeline whose step is running in this context (None: none)
_RUNNING: contextvars.ContextVar[Optional[PipelineStageManager]] = contextvars.ContextVar("pipeline_step",
                                                                                          default=None)
# a check of a call's inputs, called as a forward pre-hook with kwargs (guards/batch_check.DirectCallCheck)
InputCheck = Callable[[nn.Module, tuple, Dict[str, Any]], None]
_CALLS = "`model(**batch)`, `model.unwrap()(**batch)`, `model.unwrap().generate(...)`"


class PipelineCallError(RuntimeError):
    """A pipeline-parallel model was called in a way only `execute_pipeline` runs; the message says what to do."""


def _training_message(num_stages: int) -> str:
    return (f"Under pipeline parallelism (pp_size={num_stages}) each rank holds one stage of the model: a direct call "
            f"({_CALLS}) runs as one pipelined forward only to evaluate (under torch.no_grad() or with model.eval(); "
            f"generate runs under no_grad), made by every rank alike. To train, use "
            f"`booster.execute_pipeline(iter([batch]), model, criterion, optimizer)`.")


def _refused_message(num_stages: int, reason: str) -> str:
    return (f"Under pipeline parallelism (pp_size={num_stages}) a direct call of the model ({_CALLS}) runs as one "
            f"pipelined forward, but not this one: {reason}. Otherwise evaluate with "
            f"`booster.execute_pipeline(iter([batch]), model, criterion, return_outputs=True)` under torch.no_grad(), "
            f"or save the model with `booster.save_model(model, path)` and call or generate in one process.")


@contextlib.contextmanager
def running_step(stage_manager: PipelineStageManager) -> Iterator[None]:
    """Inside: a step of the pipeline `stage_manager` runs, so the schedule may call its model."""
    token = _RUNNING.set(stage_manager)
    try:
        yield
    finally:
        _RUNNING.reset(token)


def in_schedule() -> bool:
    """Whether a pipeline's step runs in this context (its schedule is calling the model)."""
    return _RUNNING.get() is not None


def _without_past_mask(kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The inputs to agree on: with a cache the attention mask also covers the past tokens, so it is longer than
    the ids (the check compares their shapes)."""
    if any(kwargs.get(name) is not None for name in CACHE_NAMES):
        return {k: v for k, v in kwargs.items() if k != "attention_mask"}
    return kwargs


def _trains(model: nn.Module) -> bool:
    return torch.is_grad_enabled() and model.training


class _DirectCalls:
    """The hooks of `route_direct_calls`."""

    def __init__(self, model: nn.Module, stage_manager: PipelineStageManager, pipelined: Optional[PipelinedCall],
                 unsupported: str, guard: Optional[FailureGuard], checks: Sequence[InputCheck]) -> None:
        self.model, self.stage_manager, self.pipelined = model, stage_manager, pipelined
        self.unsupported, self.guard, self.checks = unsupported, guard, tuple(checks)
        self._guarded: Optional[contextlib.ExitStack] = None  # the running call's failure guard

    def check_boosted(self, module: nn.Module, args: tuple) -> None:
        if _RUNNING.get() is not self.stage_manager and _trains(self.model):
            raise PipelineCallError(_training_message(self.stage_manager.num_stages))

    def begin(self, module: nn.Module, args: tuple, kwargs: Dict[str, Any]):
        if _RUNNING.get() is self.stage_manager:
            return None
        num_stages = self.stage_manager.num_stages
        if _trains(self.model):
            raise PipelineCallError(_training_message(num_stages))
        reason = self.unsupported if self.pipelined is None else self.pipelined.refusal(kwargs)
        if reason:
            raise PipelineCallError(_refused_message(num_stages, reason))
        if self.checks:  # the ranks agree on the inputs first: a bad one raises alike everywhere
            checked = _without_past_mask(kwargs)
            for check in self.checks:
                check(module, args, checked)
        guarded = contextlib.ExitStack()
        if self.guard is not None:  # a rank that fails inside ends the others' wait for it (guards/failure.py)
            guarded.enter_context(self.guard.step("a direct call of the model (pipelined forward)"))
        try:
            kwargs = self.pipelined.begin(kwargs)
        except BaseException:
            guarded.__exit__(*sys.exc_info())
            raise
        self._guarded = guarded
        return args, kwargs

    def end(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """(Also called while the forward's exception propagates: torch then runs always-called hooks with output
        None, inside its `except`, where `sys.exc_info()` is that exception.)"""
        if self.pipelined is None or not self.pipelined.running:
            return None
        guarded, self._guarded = self._guarded, None
        failure = sys.exc_info() if output is None else (None, None, None)
        try:
            return self.pipelined.end(output)
        finally:
            guarded.__exit__(*failure)


def route_direct_calls(boosted: nn.Module, model: nn.Module, stage_manager: PipelineStageManager,
                       pipelined: Optional[PipelinedCall], unsupported: str = "",
                       guard: Optional[FailureGuard] = None, checks: Sequence[InputCheck] = ()) -> None:
    """Calls of `boosted` (the boosted model) and `model` (the transformers model it wraps) outside a step of the
    pipeline `stage_manager`: evaluation runs `pipelined` (None: `unsupported` says why it cannot) under `guard`,
    after `checks` of its inputs (collective: guards/batch_check.py); training, and calls it refuses, raise
    PipelineCallError."""
    hooks = _DirectCalls(model, stage_manager, pipelined, unsupported, guard, checks)
    boosted.register_forward_pre_hook(hooks.check_boosted)
    # first, so that the model's other hooks (the chunked loss's) see the call as it runs
    model.register_forward_pre_hook(hooks.begin, with_kwargs=True, prepend=True)
    model.register_forward_hook(hooks.end, always_call=True)


def chunk_calls(model: nn.Module, num_chunks: int) -> List[Chunk]:
    """How the schedule calls each of this rank's `num_chunks` model chunks: the boosted `model` itself when it has
    one, else the model told which chunk to run (shardformer/stage/forward.py)."""
    if num_chunks == 1:
        return [model]
    return [functools.partial(model, **{CHUNK_ARGUMENT: chunk}) for chunk in range(num_chunks)]
