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
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Type, Union

from torch import nn

from ..layer.conv1d import is_conv1d
from ..paths import find_submodule
from ..tensor.styles import Colwise, ParallelStyle, Rowwise
from .base import Policy
from .derive import derive_entry_exit, find_layer_lists
from .plan import Plan


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
    replace: Optional[type] = None
    reversed: Optional[bool] = None
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


class Translation(NamedTuple):
    """What Parallelformers policies say about one model, a frozen value made by `translate` from the model alone."""
    lists: Mapping[str, PolicyLike]         # base-relative path of each layer list -> its policy, in model order
    tp_plan: Mapping[str, ParallelStyle]    # base-relative pattern -> style
    layers: str                             # the list a pipeline splits (with several lists, pp=1: the first)


class TranslatedPolicy(Policy):
    """Our Policy made from Parallelformers policies: a factory of the plan, whose fields it derives from the bound
    model on demand (`translate`, `divisions`, the derived pipeline split) rather than writing them in setters.

    Args:
        policies: Parallelformers policy classes (or instances), one per block class.
    """

    def __init__(self, policies: Sequence[PolicyLike]) -> None:
        super().__init__()
        self.pf_policies = list(policies)
        # memos, each with the model it was derived for: the translation (a sharded model's layers are no longer
        # the blocks the policies describe) and the derived pipeline split (one forward)
        self._translation: Optional[Tuple[nn.Module, Translation]] = None
        self._split: Optional[Tuple[nn.Module, Dict[str, str], Tuple[str, ...]]] = None

    def set_model(self, model: nn.Module) -> None:
        """Bind the model, give its modules the classes of `replace_modules()` and check the policies against it."""
        super().set_model(model)
        self._replace_classes(model)
        self._translation = (model, translate(self.pf_policies, model))

    def set_pipeline_stage_manager(self, stage_manager) -> None:
        """Refuse a pipeline over several layer lists (the split is derived from one)."""
        lists = self.translation.lists
        if stage_manager is not None and stage_manager.num_stages > 1 and len(lists) != 1:
            raise NotImplementedError(
                f"The pipeline split is derived from one list of blocks; this model has {len(lists)} "
                f"({', '.join(lists)}). Use pp_size=1 with these policies.")
        super().set_pipeline_stage_manager(stage_manager)

    # -- the fields a hand-written policy declares, derived from the bound model ------------------------------
    @property
    def translation(self) -> Translation:
        if self._translation is None or self._translation[0] is not self.model:
            self._translation = (self.model, translate(self.pf_policies, self.model))
        return self._translation[1]

    @property
    def layers(self) -> str:
        return self.translation.layers

    @property
    def tp_plan(self) -> Mapping[str, ParallelStyle]:
        return self.translation.tp_plan

    @property
    def entry(self) -> Dict[str, str]:
        return self._derived_split()[0]

    @property
    def exit(self) -> Tuple[str, ...]:
        return self._derived_split()[1]

    @property
    def tp_attributes(self) -> Dict[str, Tuple[str, ...]]:
        """The attribute divisions at the bound layout's tp size."""
        tp_size = self.shard_config.tp.size if self.shard_config is not None else 1
        return divisions(self.translation, self.model, self.model.config, tp_size)

    def plan(self, tp_size: int = 1) -> Plan:
        """The plan at `tp_size`: the attribute divisions of `replace_arguments(config, tp_size)`."""
        attributes = divisions(self.translation, self.model, self.model.config, tp_size)
        return replace(super().plan(tp_size), tp_attributes=MappingProxyType(attributes))

    def check_tp(self, config, tp_size: int) -> None:
        """Refuse `replace_arguments(config, tp_size)` values that are not exact divisions by `tp_size`."""
        divisions(self.translation, self.model, config, tp_size)

    def _derived_split(self) -> Tuple[Dict[str, str], Tuple[str, ...]]:
        """(entry, exit): derived by one forward when the bound stage manager has several stages, else none."""
        if self.stage_manager is None or self.stage_manager.num_stages <= 1:
            return {}, ()
        if self._split is None or self._split[0] is not self.model:
            entry, exit_ = derive_entry_exit(self.model, self.model.base_model, self.layers)
            self._split = (self.model, entry, tuple(exit_))
        return self._split[1], self._split[2]

    def _replace_classes(self, model: nn.Module) -> None:
        swaps = {name: new for p in self.pf_policies for name, new in p.replace_modules().items()}
        for module in model.modules():
            new = swaps.get(type(module).__name__)
            if new is not None:
                module.__class__ = new


def translate(policies: Sequence[PolicyLike], model: nn.Module) -> Translation:
    """The layer lists and tensor-parallel plan `policies` give `model` (checked against every block)."""
    base = model.base_model
    lists: Dict[str, PolicyLike] = {}
    for policy in policies:
        cls = policy.original_layer_class()
        paths = find_layer_lists(base, cls)
        if not paths:
            raise ValueError(f"{type(policy).__name__ if not isinstance(policy, type) else policy.__name__}: "
                             f"no list of {cls.__name__} blocks in {type(model).__name__}.")
        lists.update({p: policy for p in paths})
    tp_plan: Dict[str, ParallelStyle] = {}
    for path, policy in lists.items():
        tp_plan.update(_plan_of(base.get_submodule(path), path, policy))
    return Translation(MappingProxyType(lists), MappingProxyType(tp_plan), next(iter(lists)))


def divisions(translation: Translation, model: nn.Module, config, tp_size: int) -> Dict[str, Tuple[str, ...]]:
    """`replace_arguments(config, tp_size)` as attribute divisions (pattern -> attributes), refusing anything else."""
    found: Dict[str, Tuple[str, ...]] = {}
    if tp_size == 1:
        return found
    base = model.base_model
    for path, policy in translation.lists.items():
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
                attrs = found.setdefault(pattern, ())
                if attr not in attrs:
                    found[pattern] = attrs + (attr,)
    return found


def _plan_of(layers: nn.ModuleList, path: str, policy: PolicyLike) -> Dict[str, ParallelStyle]:
    plan: Dict[str, ParallelStyle] = {}
    kinds = (("attn_qkv", True), ("mlp_in", True), ("attn_out", False), ("mlp_out", False))
    for method, column in kinds:
        for layer in getattr(policy, method)():
            module = _check_layer(layers, layer, method, column)
            if module is not None:
                style = Colwise(n_fused=layer.n_fused or 1) if column else Rowwise()
                plan[f"{path}.*.{module}"] = style
    return plan


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
