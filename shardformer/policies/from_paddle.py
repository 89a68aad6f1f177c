"""Paddle-style parallel plans (`parallelize_plan`, `split_spec`) translated into our `Policy` (one of the policy
front-ends beside hand-written policies, transformers' own plans and Parallelformers-style block policies).

A plan maps module or parameter names (model-relative; `*` is one name component, or a regular expression) to
`ColWiseParallel()` / `RowWiseParallel()`; `split_spec` names the layer list to split evenly, or split points.
What a plan entry becomes:
- `ColWiseParallel` on a Linear/Conv1D: column-parallel (`Colwise`); on the LM head (outside the base model, as
  many outputs as the vocabulary): vocab-parallel head (`VocabHead`, vocab-parallel loss unless `gather_output`).
- `RowWiseParallel` on a Linear/Conv1D: row-parallel (`Rowwise`); on an Embedding: vocab-parallel (`VocabEmbedding`).
- Sequence parallelism (`SequenceParallel*`), `PrepareLayerInput/Output` and `ColWiseParallel` on an Embedding
  (a hidden-dim split) are refused with an error naming the entry.
Knowledge a plan does not carry (attributes to divide by tp, shared tp input regions, dropout RNG regions,
per-stage config) comes from the model's built-in policy when there is one.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from torch import nn

from ..layer.conv1d import is_conv1d
from ..paths import base_prefix, find_submodule, match, split_at_base
from ..tensor.styles import Colwise, ParallelStyle, Rowwise, VocabEmbedding, VocabHead
from .auto_policy import builtin_policy
from .base import Policy
from .derive import derive_entry_exit


@dataclass(frozen=True)
class ColWiseParallel:
    """Split the output features (a Linear's columns) over the mp ranks.

    Args:
        gather_output: all-gather the output (for the LM head: full logits, the model's own loss).
    """
    gather_output: bool = False


@dataclass(frozen=True)
class RowWiseParallel:
    """Split the input features (an Embedding: its vocabulary rows) over the mp ranks; outputs are all-reduced."""
    is_input_parallel: bool = True


class SplitPoint(enum.Enum):
    """Where a pipeline stage ends relative to a named layer."""
    BEGINNING = 0
    END = 1


class _Unsupported:
    """Paddle plan kinds that are accepted in a plan only to be refused with a clear error."""

    def __init__(self, *args, **kwargs) -> None:
        pass


class SequenceParallelBegin(_Unsupported):
    pass


class SequenceParallelEnd(_Unsupported):
    pass


class SequenceParallelEnable(_Unsupported):
    pass


class SequenceParallelDisable(_Unsupported):
    pass


class PrepareLayerInput(_Unsupported):
    pass


class PrepareLayerOutput(_Unsupported):
    pass


def _matches(pattern: str, name: str) -> bool:
    if match(pattern, name):
        return True
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


def resolve_plan(model: nn.Module, plan: Mapping[str, object]) -> Dict[str, ParallelStyle]:
    """{model-relative module path: our style} for a Paddle `parallelize_plan`; refuses what does not map."""
    modules = dict(model.named_modules())
    params = {n: n.rpartition(".")[0] for n, _ in model.named_parameters(remove_duplicate=False)}
    prefix = base_prefix(model)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    resolved: Dict[str, ParallelStyle] = {}
    for pattern, entry in plan.items():
        styles = list(entry) if isinstance(entry, (list, tuple)) else [entry]
        for style in styles:
            if not isinstance(style, (ColWiseParallel, RowWiseParallel)):
                kind = type(style).__name__
                raise NotImplementedError(f"parallelize_plan[{pattern!r}]: {kind} is not supported; supported are "
                                          f"ColWiseParallel() and RowWiseParallel() (no sequence parallelism).")
        if pattern.endswith((".weight", ".bias")):
            targets = sorted({params[n] for n in params if _matches(pattern, n)})
        else:
            targets = [n for n in modules if n and _matches(pattern, n)]
        if not targets:
            raise ValueError(f"parallelize_plan[{pattern!r}] matches no module or parameter of "
                             f"{type(model).__name__}.")
        if len(styles) != 1:
            raise ValueError(f"parallelize_plan[{pattern!r}]: give one ColWiseParallel() or RowWiseParallel().")
        for path in targets:
            in_base = path.startswith(prefix)
            ours = _our_style(path, modules[path], styles[0], in_base=in_base, vocab=vocab)
            if resolved.get(path, ours) != ours:
                raise ValueError(f"parallelize_plan: {path} is given two different plans ({pattern!r}).")
            resolved[path] = ours
    return resolved


def _our_style(path: str, module: nn.Module, style, in_base: bool, vocab: Optional[int]) -> ParallelStyle:
    if isinstance(module, nn.Embedding):
        if isinstance(style, RowWiseParallel):
            return VocabEmbedding()
        raise NotImplementedError(f"parallelize_plan: ColWiseParallel on the embedding {path} splits its hidden "
                                  f"dimension, which is not supported; RowWiseParallel splits its vocabulary.")
    if not isinstance(module, nn.Linear) and not is_conv1d(module):
        raise NotImplementedError(f"parallelize_plan: {path} is a {type(module).__name__}; plans apply to "
                                  f"Linear/Conv1D layers and Embeddings.")
    if isinstance(style, RowWiseParallel):
        return Rowwise()
    out_features = module.weight.shape[-1 if not isinstance(module, nn.Linear) else 0]
    if not in_base and out_features == vocab:
        return VocabHead(gather_output=style.gather_output)
    return Colwise(gather_output=style.gather_output)


def resolve_split(model: nn.Module, split_spec: Union[str, Mapping[str, SplitPoint]],
                  pp_size: int) -> Tuple[str, Optional[List[int]]]:
    """(model-relative layer list path, layers per stage or None for an even split) for a Paddle `split_spec`."""
    if isinstance(split_spec, str):
        if not isinstance(find_submodule(model, split_spec), nn.ModuleList):
            raise ValueError(f"split_spec={split_spec!r} is not a list of layers of {type(model).__name__}.")
        return split_spec, None
    bounds = set()
    layers_path = None
    for pattern, point in split_spec.items():
        if not isinstance(point, SplitPoint):
            raise ValueError(f"split_spec[{pattern!r}] must be a SplitPoint, got {point!r}.")
        names = [n for n, _ in model.named_modules() if n and _matches(pattern, n)]
        if not names:
            raise ValueError(f"split_spec[{pattern!r}] matches no module of {type(model).__name__}.")
        for name in names:
            parent, _, index = name.rpartition(".")
            if not index.isdigit() or not isinstance(model.get_submodule(parent), nn.ModuleList):
                raise ValueError(f"split_spec: {name} is not a layer of a layer list.")
            if layers_path not in (None, parent):
                raise ValueError(f"split_spec splits two layer lists ({layers_path}, {parent}); give one.")
            layers_path = parent
            bounds.add(int(index) + (point is SplitPoint.END))
    total = len(model.get_submodule(layers_path))
    cuts = sorted(b for b in bounds if 0 < b < total)
    if len(cuts) != pp_size - 1:
        raise ValueError(f"split_spec gives {len(cuts)} split points inside {layers_path} ({total} layers); "
                         f"pp={pp_size} needs {pp_size - 1}.")
    edges = [0, *cuts, total]
    return layers_path, [b - a for a, b in zip(edges, edges[1:])]


def _first_layer_list(base: nn.Module) -> str:
    lists = [name for name, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(base).__name__} has no list of layers to hold as one pipeline stage.")
    return lists[0]


class PaddlePlanPolicy(Policy):
    """Our Policy for a resolved plan and split.

    Args:
        model: the model the plan was resolved on.
        styles: {model-relative module path: style} from `resolve_plan`.
        layers: model-relative path of the layer list to split over stages ("" without a pipeline; with one, the
            entry and exit modules are derived here).
        divide_attributes: {base-relative module pattern: attribute names divided by tp} for models without a
            built-in policy (e.g. OPT's attention `num_heads`).
    """

    def __init__(self, model: nn.Module, styles: Mapping[str, ParallelStyle], layers: str = "",
                 divide_attributes: Optional[Mapping[str, Sequence[str]]] = None) -> None:
        super().__init__()
        known_cls = builtin_policy(model)
        self.known = known_cls() if known_cls is not None else None
        prefix = base_prefix(model)
        self.tp_plan, self.head_tp_plan = split_at_base(styles, prefix)
        if layers and not layers.startswith(prefix):
            raise ValueError(f"split_spec={layers!r} is outside the base model ({prefix.rstrip('.')}).")
        # the list a pipeline splits; without one (pp=1) the built-in policy's or the base model's first list
        self.layers = layers[len(prefix):] or (self.known.layers if self.known is not None else
                                              _first_layer_list(model.base_model))
        for attr in ("tp_attributes", "tp_divisible", "tp_input_regions", "local_rng_modules", "shared_rng_modules"):
            setattr(self, attr, getattr(self.known, attr) if self.known is not None else getattr(Policy, attr))
        if divide_attributes:
            self.tp_attributes = {**self.tp_attributes, **{k: tuple(v) for k, v in divide_attributes.items()}}
        if layers:  # a pipeline splits it: the entry and exit modules around it (one forward on dummy inputs)
            self.entry, self.exit = derive_entry_exit(model, model.base_model, self.layers)

    def per_layer_config(self) -> Dict[str, Tuple[object, ...]]:
        return self.known.per_layer_config() if self.known is not None else {}
