"""Parallelformers-style policies (Parallelformers' `Policy`, here `ParallelformersPolicy`, with `Layer` lists per
block class), translated into our `Policy` (one of the policy front-ends beside hand-written policies, transformers'
own plans and Paddle-style plans).

A Parallelformers policy describes one block class: which of its weights are the attention q/k/v and output and
the MLP input and output projections, which attributes change under tensor parallelism (`replace_arguments`) and
which classes to swap (`replace_modules`). `translate(policies)` turns one or several of them (e.g. encoder and
decoder blocks) into a `shardformer.Policy`: q/k/v and MLP inputs column-parallel (fused areas split separately),
outputs row-parallel, attributes divided, and — with one layer list — the pipeline split derived from the model.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Type, Union

from torch import nn

from ..layer.conv1d import is_conv1d
from ..paths import find_submodule
from ..tensor.styles import Colwise, ParallelStyle, Rowwise
from .base import Policy
from .derive import derive_entry_exit, find_layer_lists


@dataclass
class Layer:
    """One weight (and bias) of a block, as Parallelformers describes it.

    Args:
        weight: block-relative name of the weight, e.g. "attn.c_attn.weight" ("layer[0].x" means "layer.0.x").
        bias: block-relative name of the bias of the same module, or None.
        n_fused: number of fused areas (3 for a fused q|k|v); each area is split over the tp ranks separately.
        replace: None, or the Parallelformers all-reduce class for an output layer (`AllReduceLinear`,
            `AllReduceConv1D`): our row-parallel layer takes its place either way.
        reversed: True when the weight is stored (in, out), as transformers' Conv1D does; must match the module.
        ignore_checker: tolerate blocks that do not have this module (e.g. optional cross-attention).
    """
    weight: Optional[str] = None
    bias: Optional[str] = None
    n_fused: Optional[int] = None
    replace: Any = None
    reversed: Any = None
    ignore_checker: bool = False


class ParallelformersPolicy(ABC):
    """Parallelformers' policy (its `Policy`) for one block class; override the static methods that apply."""

    @staticmethod
    def replace_arguments(config, world_size: int) -> Dict[str, Any]:
        """Block-relative attribute -> its value under `world_size`-way tensor parallelism."""
        return {}

    @staticmethod
    def replace_modules() -> Dict[str, Type[nn.Module]]:
        """Class name of modules in the model -> class to give them (their state is kept)."""
        return {}

    @staticmethod
    def attn_qkv() -> List[Layer]:
        return []

    @staticmethod
    def attn_out() -> List[Layer]:
        return []

    @staticmethod
    def mlp_in() -> List[Layer]:
        return []

    @staticmethod
    def mlp_out() -> List[Layer]:
        return []

    @staticmethod
    @abstractmethod
    def original_layer_class() -> Type[nn.Module]:
        """The block class this policy applies to, e.g. GPT2Block."""


PolicyLike = Union[Type[ParallelformersPolicy], ParallelformersPolicy]
_ALL_REDUCE_NAMES = ("AllReduceLinear", "AllReduceConv1D")


def _module_path(name: str) -> str:
    return name.replace("[", ".").replace("]", "").rpartition(".")[0]


class TranslatedPolicy(Policy):
    """Our Policy made from Parallelformers policies; derives everything from the model in `set_model`.

    Args:
        policies: Parallelformers policy classes (or instances), one per block class.
    """

    def __init__(self, policies: Sequence[PolicyLike]) -> None:
        super().__init__()
        self.pf_policies = list(policies)
        self._lists: Dict[str, PolicyLike] = {}  # base-relative layer list path -> its policy

    def set_model(self, model: nn.Module) -> None:
        super().set_model(model)
        self._replace_classes(model)
        base = model.base_model
        self._lists = {}
        for policy in self.pf_policies:
            cls = policy.original_layer_class()
            paths = find_layer_lists(base, cls)
            if not paths:
                raise ValueError(f"{type(policy).__name__ if not isinstance(policy, type) else policy.__name__}: "
                                 f"no list of {cls.__name__} blocks in {type(model).__name__}.")
            self._lists.update({p: policy for p in paths})
        self.tp_plan = {}
        for path, policy in self._lists.items():
            self.tp_plan.update(self._plan_of(base.get_submodule(path), path, policy))
        # the list a pipeline splits; with several lists (pp=1 only) the first, which one stage holds whole
        self.layers = next(iter(self._lists))

    def set_pipeline_stage_manager(self, stage_manager) -> None:
        """With several stages, derive the split (one forward on dummy inputs): the layer list, entry and exit."""
        if stage_manager is not None and stage_manager.num_stages > 1:
            if len(self._lists) != 1:
                raise NotImplementedError(
                    f"The pipeline split is derived from one list of blocks; this model has {len(self._lists)} "
                    f"({', '.join(self._lists)}). Use pp_size=1 with these policies.")
            self.entry, self.exit = derive_entry_exit(self.model, self.model.base_model, self.layers)
        super().set_pipeline_stage_manager(stage_manager)

    def _replace_classes(self, model: nn.Module) -> None:
        swaps = {name: new for p in self.pf_policies for name, new in p.replace_modules().items()}
        for module in model.modules():
            new = swaps.get(type(module).__name__)
            if new is not None:
                module.__class__ = new

    def _plan_of(self, layers: nn.ModuleList, path: str, policy: PolicyLike) -> Dict[str, ParallelStyle]:
        plan: Dict[str, ParallelStyle] = {}
        kinds = (("attn_qkv", True), ("mlp_in", True), ("attn_out", False), ("mlp_out", False))
        for method, column in kinds:
            for layer in getattr(policy, method)():
                module = self._check_layer(layers, layer, method, column)
                if module is not None:
                    style = Colwise(n_fused=layer.n_fused or 1) if column else Rowwise()
                    plan[f"{path}.*.{module}"] = style
        return plan

    @staticmethod
    def _check_layer(layers: nn.ModuleList, layer: Layer, method: str, column: bool) -> Optional[str]:
        """The block-relative module path of `layer`, after checking it against every block."""
        what = f"{method}() Layer(weight={layer.weight!r})"
        if not layer.weight:
            raise ValueError(f"{what}: a weight name is required.")
        path = _module_path(layer.weight)
        if layer.bias is not None and _module_path(layer.bias) != path:
            raise ValueError(f"{what}: bias {layer.bias!r} belongs to another module than the weight.")
        if not column and (layer.n_fused or 1) != 1:
            raise ValueError(f"{what}: n_fused={layer.n_fused} on an output (row-parallel) layer is not supported.")
        if layer.replace is not None and getattr(layer.replace, "__name__", None) not in _ALL_REDUCE_NAMES:
            raise ValueError(f"{what}: replace={layer.replace!r} is not supported; our column/row-parallel layers "
                             f"take the place of q/k/v/MLP-in and output layers: pass replace=None.")
        if layer.replace is not None and column:
            raise ValueError(f"{what}: replace={layer.replace.__name__} all-reduces outputs; it belongs to "
                             f"attn_out()/mlp_out(), not {method}().")
        present = 0
        for block in layers:
            module = find_submodule(block, path)
            if module is None:
                continue
            present += 1
            if not isinstance(module, nn.Linear) and not is_conv1d(module):
                raise TypeError(f"{what}: {type(module).__name__} is neither nn.Linear nor transformers Conv1D.")
            if layer.reversed is not None and bool(layer.reversed) != is_conv1d(module):
                stored = "(in, out) as Conv1D" if is_conv1d(module) else "(out, in) as nn.Linear"
                raise ValueError(f"{what}: reversed={layer.reversed} but {type(block).__name__}.{path} stores its "
                                 f"weight {stored}: set reversed={not layer.reversed}.")
            if layer.bias is not None and getattr(module, "bias", None) is None:
                raise ValueError(f"{what}: {type(block).__name__}.{path} has no bias {layer.bias!r}.")
        if present == 0 and not layer.ignore_checker:
            raise ValueError(f"{what}: {type(layers[0]).__name__} has no module {path!r} (set ignore_checker=True "
                             f"if it is optional).")
        return path if present else None

    def check_tp(self, config, tp_size: int) -> None:
        """Turn `replace_arguments(config, tp_size)` into attribute divisions, refusing anything else."""
        self.tp_attributes = {}
        if tp_size == 1:
            return
        base = self.model.base_model
        for path, policy in self._lists.items():
            blocks = base.get_submodule(path)
            for key, value in policy.replace_arguments(config, tp_size).items():
                owner, _, attr = key.rpartition(".")
                for block in blocks:
                    module = find_submodule(block, owner)
                    if module is None:
                        continue  # e.g. cross-attention this configuration does not build
                    if not hasattr(module, attr):
                        raise ValueError(f"replace_arguments: {type(block).__name__}.{key} does not exist.")
                    current = getattr(module, attr)
                    if not isinstance(current, int) or value * tp_size != current:
                        raise ValueError(f"replace_arguments: {key}={value!r} with tp_size={tp_size}, but it is "
                                         f"{current!r} unsharded: only exact division by tp_size is supported "
                                         f"(is tp_size a divisor of {current!r}?).")
                    pattern = f"{path}.*.{owner}" if owner else f"{path}.*"
                    attrs = self.tp_attributes.setdefault(pattern, ())
                    if attr not in attrs:
                        self.tp_attributes[pattern] = attrs + (attr,)


def as_policy(policy: Union[None, Policy, PolicyLike, Sequence[PolicyLike]]) -> Optional[Policy]:
    """Our Policy for `HybridParallelPlugin(custom_policy=...)`: ours as is, Parallelformers ones translated.

    Args:
        policy: None, a `shardformer.Policy`, or a Parallelformers policy class/instance or a list of them.
    """
    if policy is None or isinstance(policy, Policy):
        return policy
    many = list(policy) if isinstance(policy, (list, tuple)) else [policy]
    for p in many:
        if isinstance(p, type) and issubclass(p, Policy):
            raise TypeError(f"custom_policy must be a shardformer.Policy instance, got the class {p.__name__} "
                            f"(pass an instance: custom_policy={p.__name__}()).")
        block_policy = isinstance(p, type) and issubclass(p, ParallelformersPolicy)
        if not (isinstance(p, ParallelformersPolicy) or block_policy):
            raise TypeError(f"custom_policy must be a shardformer.Policy instance or Parallelformers-style policies "
                            f"(shardformer.policies.from_parallelformers.ParallelformersPolicy subclasses), got "
                            f"{type(p).__name__}.")
    return TranslatedPolicy(many)
