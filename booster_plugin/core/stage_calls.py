"""Under pipeline parallelism a rank holds one stage of the model, so only the pipeline schedule may call it.

A call the script makes itself (`model(**batch)`, `model.unwrap()(**batch)`, `model.unwrap().generate(...)`) would
run one stage's part of the forward: the first stage fails on a module it does not hold, a later one runs on a
stand-in embedding's zeros and returns garbage. Forward pre-hooks on the boosted model and on the transformers model
inside it refuse such calls on every rank alike, before anything runs; `execute_pipeline` runs its step inside
`running_step(stage_manager)`, which is all the hooks look at. The schedule calls the model through `chunk_calls`:
one callable per model chunk (virtual stage) this rank holds.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Iterator, List, Optional

from torch import nn

from pipeline import PipelineStageManager
from pipeline.step import Chunk
from shardformer.stage.forward import CHUNK_ARGUMENT

__all__ = ["PipelineCallError", "chunk_calls", "refuse_calls_outside_schedule", "running_step"]

# the pipeline whose step is running in this context (None: none)
_RUNNING: contextvars.ContextVar[Optional[PipelineStageManager]] = contextvars.ContextVar("pipeline_step",
                                                                                          default=None)


class PipelineCallError(RuntimeError):
    """A pipeline-parallel model was called outside `execute_pipeline`; the message says what to do instead."""


def _message(num_stages: int) -> str:
    return (f"Under pipeline parallelism (pp_size={num_stages}) each rank holds one stage of the model, so the model "
            f"cannot be called directly (`model(**batch)`, `model.unwrap()(**batch)`, `model.unwrap().generate(...)`)."
            f" To train or evaluate, use `booster.execute_pipeline(iter([batch]), model, criterion, optimizer)` "
            f"(evaluation: under torch.no_grad(), or with model.eval() and no optimizer). To generate, save the model "
            f"with `booster.save_model(model, path)` and generate in one process "
            f"(`AutoModelForCausalLM.from_pretrained(path).generate(...)`), or boost with pp_size=1 (tensor "
            f"parallelism alone generates).")


@contextlib.contextmanager
def running_step(stage_manager: PipelineStageManager) -> Iterator[None]:
    """Inside: a step of the pipeline `stage_manager` runs, so the schedule may call its model."""
    token = _RUNNING.set(stage_manager)
    try:
        yield
    finally:
        _RUNNING.reset(token)


def refuse_calls_outside_schedule(modules: tuple[nn.Module, ...], stage_manager: PipelineStageManager) -> None:
    """Make `modules` (the boosted model, the transformers model it wraps) raise PipelineCallError when called while
    no step of the pipeline `stage_manager` runs (`running_step`)."""
    message = _message(stage_manager.num_stages)

    def refuse(module: nn.Module, args: tuple) -> None:
        if _RUNNING.get() is not stage_manager:
            raise PipelineCallError(message)

    for module in modules:
        module.register_forward_pre_hook(refuse)


def chunk_calls(model: nn.Module, num_chunks: int) -> List[Chunk]:
    """How the schedule calls each of this rank's `num_chunks` model chunks: the boosted `model` itself when it has
    one, else the model told which chunk to run (shardformer/stage/forward.py)."""
    if num_chunks == 1:
        return [model]
    return [functools.partial(model, **{CHUNK_ARGUMENT: chunk}) for chunk in range(num_chunks)]
