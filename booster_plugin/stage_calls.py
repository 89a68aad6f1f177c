"""Under pipeline parallelism a rank holds one stage of the model, so only the pipeline schedule may call it.

A call the script makes itself (`model(**batch)`, `model.unwrap()(**batch)`, `model.unwrap().generate(...)`) would
run one stage's part of the forward: the first stage fails on a module it does not hold, a later one runs on a
stand-in embedding's zeros and returns garbage. Forward pre-hooks on the boosted model and on the transformers model
inside it refuse such calls on every rank alike, before anything runs; inside a step the schedule has set the stage
manager's `model_chunk_id`, which is all the hooks look at.
"""
from __future__ import annotations

from torch import nn

from pipeline import PipelineStageManager

__all__ = ["PipelineCallError", "refuse_calls_outside_schedule"]


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


def refuse_calls_outside_schedule(modules: tuple[nn.Module, ...], stage_manager: PipelineStageManager) -> None:
    """Make `modules` (the boosted model, the transformers model it wraps) raise PipelineCallError when called while
    no pipeline step runs (the stage manager's `model_chunk_id` is None)."""
    message = _message(stage_manager.num_stages)

    def refuse(module: nn.Module, args: tuple) -> None:
        if stage_manager.model_chunk_id is None:
            raise PipelineCallError(message)

    for module in modules:
        module.register_forward_pre_hook(refuse)
