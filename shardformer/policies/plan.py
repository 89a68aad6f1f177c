"""A model's plan as a frozen value: what the transforms of sharder.py read (never the policy object).

Every policy front-end (hand-written families, transformers' declared plans, inferred plans, Paddle-style and
Parallelformers-style plans, encoder-decoder policies) is a factory of it: `Policy.plan(tp_size)` on the policy bound
to the unsharded model, after its checks; the plan is fitted to the tp size (e.g. key/value heads replicated where tp
ranks outnumber them) without rewriting the policy.
Paths are relative to the base model (`base_prefix`) unless said otherwise; `*` stands for one name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Mapping, Optional, Sequence, Tuple

from torch import nn

from ..paths import match

if TYPE_CHECKING:  # the styles' type only
    from ..tensor.styles import ParallelStyle

__all__ = ["Plan", "per_layer"]

# a policy's own stage pruning (encoder-decoder): prunes the bound model to this stage, returns its runner
ReleaseHook = Callable[[], Optional[Callable[..., object]]]


@dataclass(frozen=True)
class Plan:
    """Pipeline structure, tensor-parallel plan and dropout regions of one model, read by the transforms."""
    base_prefix: str                                    # '' when the model is its own base model, else 'model.'
    layers: str                                         # the repeated layer list ('' for none, or two stacks)
    layer_lists: Tuple[str, ...]                        # every layer list the pipeline splits, in order
    entry: Mapping[str, str]                            # module only the first stage holds -> stand-in kind
    exit: Tuple[str, ...]                               # modules only the last stage holds
    heads: Tuple[str, ...]                              # model-relative modules outside the base (last stage)
    tp_plan: Mapping[str, "ParallelStyle"]              # pattern -> style
    head_tp_plan: Mapping[str, "ParallelStyle"]         # model-relative pattern (outside the base) -> style
    tp_attributes: Mapping[str, Tuple[str, ...]]        # pattern -> attributes divided by the tp size
    tp_attribute_values: Mapping[str, Mapping[str, object]]  # pattern -> attributes set (if present)
    tp_divisible: Tuple[str, ...]                       # config attributes the tp size must divide
    tp_input_regions: Tuple[str, ...]                   # modules whose input all their column layers share
    local_rng_modules: Tuple[str, ...]                  # dropout on split heads: per-rank masks
    shared_rng_modules: Tuple[str, ...]                 # inside those, dropout on replicated data
    first_stage_inputs: Tuple[str, ...]                 # call keywords only the first stage's entry modules read
    per_layer_config: Mapping[str, Tuple[object, ...]]  # config attributes with one value per layer (layer_types)
    release: Optional[ReleaseHook] = None               # the policy prunes its stages itself (encoder-decoder)

    def layer_list(self, model: nn.Module) -> nn.ModuleList:
        """The (held) layers of `model`: its layer list, or its layer lists one after the other."""
        lists = [model.get_submodule(self.base_prefix + path) for path in self.layer_lists]
        if len(lists) == 1:
            return lists[0]
        return nn.ModuleList([layer for layers in lists for layer in layers])

    def inside_layers(self, rel: str) -> bool:
        """Is the base-relative path `rel` (a module or parameter) inside the layer list?"""
        return rel.startswith(self.layers + ".")

    def style(self, path: str, skip: Callable[[str], bool] = lambda rel: False) -> Optional["ParallelStyle"]:
        """The plan's style of the model-relative `path` (None: none, or `skip` says so of a base-relative one)."""
        prefix = self.base_prefix
        if path.startswith(prefix):
            if skip(path[len(prefix):]):
                return None
            for pattern, style in self.tp_plan.items():
                if match(pattern, path[len(prefix):]):
                    return style
        for pattern, style in self.head_tp_plan.items():
            if match(pattern, path):
                return style
        return None

    def stage_config(self, start: int, end: int) -> Dict[str, object]:
        """Config attributes a stage holding layers [start, end) sees: its slice of the per-layer ones."""
        return {attr: list(values[start:end]) for attr, values in self.per_layer_config.items() if len(values) >= end}


def per_layer(config, attrs: Sequence[str] = ("layer_types",)) -> Dict[str, Tuple[object, ...]]:
    """The per-layer attributes `config` sets itself (a config computing them from other fields keeps them)."""
    own = vars(config) if config is not None else {}
    return {a: tuple(own[a]) for a in attrs if isinstance(own.get(a), (list, tuple))}
