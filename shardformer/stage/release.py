"""A pipeline stage of a model with one layer list: release what this rank's stages do not hold (see forward.py) and
build the callable that runs each of its chunks (virtual stages). Policies with another stage structure declare
their own (`Plan.release`: `Policy.release_unheld_layers`, e.g. encoder_decoder.py)."""
from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence, TYPE_CHECKING, Tuple

from torch import nn

from pipeline.stage_manager import PipelineStageManager

from .forward import (ChunkView, Released, StageForward, get_submodule_parent, held_layer_list, replace_submodule,
                      stand_in_for)

if TYPE_CHECKING:  # the plan's type only: plans import this room's vocabulary, not the reverse
    from ..policies.plan import Plan

__all__ = ["release_unheld"]


def release_unheld(model: nn.Module, plan: Plan, sm: PipelineStageManager, split: Sequence[int]
                   ) -> Optional[StageForward]:
    """Keep the layers of this rank's chunks (`split`: layers of each virtual stage), the entry modules where the
    first virtual stage is held (stand-ins elsewhere, and for this rank's other chunks), the exit and head where the
    last is; the stage's runner (None with one stage)."""
    ranges = sm.get_stage_index(list(split), num_model_chunks=sm.num_model_chunks)
    ranges = [ranges] if sm.num_model_chunks == 1 else ranges
    stages = sm.layout.stages_of(sm.stage)
    last = sm.layout.num_stages - 1
    layers = plan.layer_list(model)
    stand_ins = _stand_ins(model, plan)
    if 0 not in stages:  # the stand-ins for good
        for path, module in stand_ins.items():
            replace_submodule(model, path, module)
    if last not in stages:
        _release_exit(model, plan)
    if 0 in stages and len(stages) > 1 and stand_ins:  # swapped in for the other chunks
        # registered after the head's release (which takes every top-level module but the base model), so that
        # model.to(dtype) reaches them: their zeros, and the rotary tables built from them, follow the model
        model.pipeline_stand_ins = nn.ModuleDict({p.replace(".", "__"): m for p, m in stand_ins.items()})
    held = held_layer_list(layers, [i for start, end in ranges for i in range(start, end)])
    replace_submodule(model, plan.base_prefix + plan.layers, held)
    if sm.layout.num_stages == 1:
        return None
    loop = _loop_owner(model, plan)
    chunks = _chunk_views(plan, layers, stages, ranges, stand_ins, last, loop.config)
    return StageForward(model, chunks, held, plan.first_stage_inputs, loop)


def _loop_owner(model: nn.Module, plan: Plan) -> nn.Module:
    """The module whose forward loops over the layer list (the base model, or e.g. a vision-language model's
    language model): its config is the one a chunk's view replaces."""
    return model.get_submodule((plan.base_prefix + plan.layers).rpartition(".")[0])


def _stand_ins(model: nn.Module, plan: Plan) -> Dict[str, nn.Module]:
    """Model-relative path -> stand-in, for each entry module the model has."""
    base, prefix = model.base_model, plan.base_prefix
    stand_ins: Dict[str, nn.Module] = {}
    for path, kind in plan.entry.items():
        parent, name = get_submodule_parent(base, path)
        if getattr(parent, name, None) is None:  # optional module this model does not have
            continue
        stand_ins[prefix + path] = stand_in_for(kind, base.get_submodule(path), prefix + path)
    return stand_ins


def _release_exit(model: nn.Module, plan: Plan) -> None:
    """Release the exit modules and the head (the last stage's)."""
    base, prefix = model.base_model, plan.base_prefix
    for path in plan.exit:
        if getattr(*get_submodule_parent(base, path)) is not None:
            replace_submodule(base, path, Released(prefix + path))
    for name in plan.heads:
        setattr(model, name, Released(name))


def _chunk_views(plan: Plan, layers: nn.ModuleList, stages: Sequence[int], ranges: List[Tuple[int, int]],
                 stand_ins: Dict[str, nn.Module], last: int, config) -> List[ChunkView]:
    """How the model looks while each of this rank's chunks runs (`config`: that of the layers' loop)."""
    chunks = []
    for stage, (start, end) in zip(stages, ranges):
        overrides = plan.stage_config(start, end)
        view = None
        if overrides:  # a chunk-local config view for the base model's loop; the model's own is untouched
            view = copy.copy(config)
            for key, value in overrides.items():
                setattr(view, key, value)
        first_here = stage == 0 or 0 not in stages
        chunks.append(ChunkView(
            layer_keys=None if len(ranges) == 1 else [str(i) for i in range(start, end)],
            entry_layer=None if stage == 0 else layers[start],
            modules={} if first_here else stand_ins,
            exit_layer=None if stage == last else layers[end - 1], config=view))
    return chunks
