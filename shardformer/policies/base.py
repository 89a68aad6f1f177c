"""Policy: the small, declarative per-model knowledge that pipeline and tensor parallelism need.

A policy names, relative to the model's base model (e.g. `model` of LlamaForCausalLM): the repeated layer list,
the entry modules only the first stage holds (and what stands in for them elsewhere), the exit modules only the
last stage holds, and a tensor-parallel plan (module pattern -> parallel style, `*` for a layer index). Modules
outside the base model (LM head, classifier) belong to the last stage. Everything else is derived.
"""
from __future__ import annotations

import math
from types import MappingProxyType
from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from pipeline.stage_manager import PipelineStageManager, StageCosts

from ..stage.layer_bounds import stage_of_layer
from ..paths import base_prefix, find_submodule, match
from ..shard_config import ShardConfig
from ..stage.forward import IDENTITY, INPUT, SHAPED, ZEROS
from ..stage.placement import StagePlacement, place
from .plan import Plan, ReleaseHook
from ..tensor.styles import (Colwise, Experts, GradAllReduce, HeadEmbedding, KVHeads, OwnHeads, ParallelStyle, Rowwise,
                      SharedTailGrad, SplitParam, VocabEmbedding, VocabHead)

# what a policy is written with: the Policy, the entry modules' stand-in kinds and the parallel styles
__all__ = ["Policy", "IDENTITY", "INPUT", "SHAPED", "ZEROS", "Colwise", "Rowwise", "GradAllReduce", "VocabEmbedding", "VocabHead",
           "HeadEmbedding", "KVHeads", "OwnHeads", "SharedTailGrad", "SplitParam", "Experts", "ParallelStyle"]

EMBEDDING_COST = 0.25  # an embedding lookup (and its gradient) per parameter, relative to a matmul's


class Policy:
    """Base policy. Subclasses fill in the class attributes; the methods derive the rest."""

    layers: str = ""                                # base-relative path of the repeated layer ModuleList
    entry: Dict[str, str] = {}                      # base-relative module -> stand-in kind on non-first stages
    exit: Sequence[str] = ()                        # base-relative modules only the last stage holds
    tp_plan: Dict[str, ParallelStyle] = {}          # base-relative pattern -> style
    head_tp_plan: Dict[str, ParallelStyle] = {}     # model-relative pattern (outside the base) -> style
    tp_attributes: Dict[str, Sequence[str]] = {}    # base-relative pattern -> attributes divided by tp_size
    tp_attribute_values: Dict[str, Dict[str, object]] = {}  # base-relative pattern -> attributes set (if present)
    tp_divisible: Sequence[str] = ()                # config attributes that must be divisible by tp_size
    tp_input_regions: Sequence[str] = ()           # base-relative modules whose input all column layers share
    local_rng_modules: Sequence[str] = ()           # base-relative patterns whose dropout acts on split heads
    shared_rng_modules: Sequence[str] = ()          # patterns inside those whose dropout acts on replicated data
    first_stage_inputs: Sequence[str] = ()          # call keywords only the first stage's entry modules read
    # hook for a policy whose stages are not one layer list (encoder-decoder): it prunes the model to this stage
    # itself and returns the callable that runs the stage; None: the sharder releases layers, entry and exit
    release_unheld_layers: Optional[ReleaseHook] = None

    def __init__(self) -> None:
        self.model: Optional[nn.Module] = None
        self.stage_manager: Optional[PipelineStageManager] = None
        self.shard_config: Optional[ShardConfig] = None
        # the placement, with the model and stage manager it was derived for (see stage_placement)
        self._placement: Optional[Tuple[nn.Module, Optional[PipelineStageManager], StagePlacement]] = None

    # -- ColossalAI-style setters ---------------------------------------------------------------------------
    def set_model(self, model: nn.Module) -> None:
        """Bind the policy to the (unsharded) model."""
        self.model = model

    def set_pipeline_stage_manager(self, stage_manager: Optional[PipelineStageManager]) -> None:
        self.stage_manager = stage_manager

    def set_shard_config(self, shard_config: ShardConfig) -> None:
        self.shard_config = shard_config

    # -- the plan, a frozen value --------------------------------------------------------------------------
    def plan(self, tp_size: int = 1) -> Plan:
        """This policy's plan as a frozen value (plan.py), on the bound model, for `tp_size`: what the transforms
        read (the same for every tp size here)."""
        return Plan(base_prefix=self.base_prefix, layers=self.layers, layer_lists=tuple(self.layer_paths()),
                    entry=MappingProxyType(dict(self.entry)), exit=tuple(self.exit), heads=tuple(self.head_modules()),
                    tp_plan=MappingProxyType(dict(self.tp_plan)),
                    head_tp_plan=MappingProxyType(dict(self.head_tp_plan)),
                    tp_attributes=MappingProxyType({k: tuple(v) for k, v in self.tp_attributes.items()}),
                    tp_attribute_values=MappingProxyType({k: MappingProxyType(dict(v))
                                                          for k, v in self.tp_attribute_values.items()}),
                    tp_divisible=tuple(self.tp_divisible),
                    tp_input_regions=tuple(self.tp_input_regions), local_rng_modules=tuple(self.local_rng_modules),
                    shared_rng_modules=tuple(self.shared_rng_modules),
                    first_stage_inputs=tuple(self.first_stage_inputs),
                    per_layer_config=MappingProxyType(self.per_layer_config()), release=self.release_unheld_layers)

    def layer_paths(self) -> Tuple[str, ...]:
        """Base-relative paths of the layer lists the pipeline splits, in order."""
        return (self.layers,) if self.layers else ()

    def per_layer_config(self) -> Dict[str, Tuple[object, ...]]:
        """Config attributes with one value per layer, of which a stage sees its own slice (default: none)."""
        return {}

    # -- structure ----------------------------------------------------------------------------------------
    @property
    def base_prefix(self) -> str:
        """'' when the model is its own base model, else e.g. 'transformer.'."""
        return base_prefix(self.model)

    def layer_list(self) -> nn.ModuleList:
        return self.model.get_submodule(self.base_prefix + self.layers)

    def check_paths(self) -> None:
        """Refuse a policy whose module paths do not exist in the model, naming the policy entry and what exists."""
        base, name = self.model.base_model, type(self).__name__

        def refuse(entry: str, path: str) -> None:
            parent, _, _ = path.rpartition(".")
            found = find_submodule(base, parent)
            children = [n for n, _ in (base if found is None else found).named_children()]
            raise ValueError(f"{name}.{entry} names {path!r}, which {type(base).__name__} (the base model of "
                             f"{type(self.model).__name__}) does not have; there, {parent or 'the base model'} has "
                             f"{children}. Paths are relative to the base model.")

        if self.layers and not isinstance(find_submodule(base, self.layers), nn.ModuleList):
            refuse("layers", self.layers)
        for entry, paths in (("entry", list(self.entry)), ("exit", list(self.exit))):
            for path in paths:
                parent = path.rpartition(".")[0]
                if parent and find_submodule(base, parent) is None:
                    refuse(entry, path)

    def check_plan(self) -> None:
        """Refuse tp plan entries that match no module or parameter of the model (a typo would leave that layer
        unsharded and fail later with a shape error) or whose value is not a style instance, naming the entry and
        what the model has where the pattern stops matching. For plans written by hand (custom policies)."""
        name = type(self).__name__
        for where, plan, root in (("tp_plan", self.tp_plan, self.model.base_model),
                                  ("head_tp_plan", self.head_tp_plan, self.model)):
            paths = [n for n, _ in root.named_modules() if n] + [n for n, _ in root.named_parameters()]
            for pattern, style in plan.items():
                if not isinstance(style, ParallelStyle):
                    what = f"the class {style.__name__}" if isinstance(style, type) else repr(style)
                    raise TypeError(f"{name}.{where}[{pattern!r}] is {what}, not a parallel style: write an instance, "
                                    f"e.g. Colwise().")
                if not any(match(pattern, p) for p in paths):
                    raise ValueError(f"{name}.{where}[{pattern!r}] matches no module or parameter of "
                                     f"{type(root).__name__}{_nearest(root, pattern)}. Fix the pattern: it is "
                                     f"relative to {'the base model' if where == 'tp_plan' else 'the model'}, "
                                     f"'*' standing for one name (e.g. a layer index).")

    # -- the pipeline placement ---------------------------------------------------------------------------
    def stage_placement(self) -> StagePlacement:
        """Where the unsharded model's layers and parameters live over the pipeline (stage/placement.py): derived
        on the bound model and stage manager at first use and kept for that pair (ColossalAI's methods below are
        asked after sharding too, when the model holds one stage's part only)."""
        if self._placement is None or self._placement[0] is not self.model or \
                self._placement[1] is not self.stage_manager:
            self._placement = (self.model, self.stage_manager, self._derive_placement())
        return self._placement[2]

    def _derive_placement(self) -> StagePlacement:
        stacks, sm = tuple(self.layer_stacks()), self.stage_manager
        named = self.model.named_parameters(remove_duplicate=False)
        if sm is None:
            return place(stacks, (sum(stacks),), named, lambda name: (0,))
        split = tuple(sm.layers_per_virtual_stage(sum(stacks), self.stage_costs))
        self.check_split(list(split))
        return place(stacks, split, named, lambda name: self.place_param(name, split, stacks))

    def layer_stacks(self) -> Tuple[int, ...]:
        """Layers of each layer list of the unsharded model, in pipeline order (one list here)."""
        return (len(self.layer_list()),)

    def check_split(self, split: List[int]) -> None:
        """Refuse a pipeline split (layers of each virtual stage) the model's forward cannot run (default: none)."""

    def num_layers(self) -> int:
        """Layers of the unsharded model."""
        return self.stage_placement().num_layers

    def layers_per_stage(self) -> List[int]:
        """Layers of each virtual stage, decided on the unsharded model (needed by num_layers_per_stage="auto")."""
        return list(self.stage_placement().split)

    def stage_costs(self) -> StageCosts:
        """Estimated compute for num_layers_per_stage="auto": a matmul's work grows with its parameters, so a layer
        costs its parameter count, the last stage adds its exit modules and head (the LM head, even when tied, plus
        its loss), the first its entry modules at EMBEDDING_COST per parameter (a lookup, and in backward a dense
        gradient as large as the table)."""
        count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
        layers = [float(count(layer)) for layer in self.layer_list()]
        first = EMBEDDING_COST * sum(count(m) for m in self._present(self.entry))
        last = sum(count(m) for m in self._present(self.exit)) + sum(count(m) for m in self.head_modules().values())
        return StageCosts(layers, float(first), float(last))

    def stage_of_param(self, name: str) -> Optional[Tuple[int, ...]]:
        """The pipeline stages (ranks along the pipeline) that hold parameter `name` (model-relative)."""
        return self.stage_placement().stage_of_param(name)

    def place_param(self, name: str, split: Tuple[int, ...], stacks: Tuple[int, ...]) -> Tuple[int, ...]:
        """The pipeline ranks holding parameter `name` of the unsharded model under `split`."""
        sm = self.stage_manager
        n, rank_of, last = sm.num_stages, sm.layout.rank_of, sm.layout.num_stages - 1
        prefix = self.base_prefix
        layers = prefix + self.layers + "."
        if name.startswith(layers):
            return (rank_of(stage_of_layer(split, int(name[len(layers):].split(".")[0]))),)
        if any(name.startswith(prefix + e + ".") for e in self.entry):
            return (rank_of(0),)
        if any(name.startswith(prefix + e + ".") for e in self.exit) or not name.startswith(prefix):
            return (rank_of(last),)
        return tuple(range(n))  # used by every stage (rare): kept everywhere, gradients summed over stages

    def get_held_layers(self) -> List[nn.Module]:
        """Modules (layers, entry, exit, head) held by this rank's stage (all its chunks)."""
        sm = self.stage_manager
        ranges = sm.get_stage_index(self.layers_per_stage(), num_model_chunks=sm.num_model_chunks)
        ranges = [ranges] if sm.num_model_chunks == 1 else ranges
        # by key, not position: after sharding the list keeps only this stage's layers, under their HF indices
        held = [m for key, m in self.layer_list()._modules.items() if any(s <= int(key) < e for s, e in ranges)]
        if sm.is_first_stage():
            held += self._present(self.entry)
        if sm.is_last_stage():
            held += self._present(self.exit) + list(self.head_modules().values())
        return held

    def _present(self, paths) -> List[nn.Module]:
        """The modules at the base-relative `paths` the model has (entry and exit modules may be optional)."""
        found = (find_submodule(self.model.base_model, path) for path in paths)
        return [m for m in found if m is not None]

    def head_modules(self) -> Dict[str, nn.Module]:
        """Top-level modules outside the base model (LM head, classifier): the last stage holds them."""
        if not self.base_prefix:
            return {}
        return {name: m for name, m in self.model.named_children() if not self.base_prefix.startswith(name + ".")}

    def shared_param_names(self) -> List[Dict[int, str]]:
        """Parameters held by several stages (e.g. a tied embedding / LM head): {stage: its name there}."""
        return self.stage_placement().shared_names()

    def get_shared_params(self) -> List[Dict[int, nn.Parameter]]:
        """ColossalAI's form of `shared_param_names`: {stage: parameter}, resolved on this rank's model."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        return [{s: params[n] for s, n in names.items() if n in params} for names in self.shared_param_names()]

    # -- tensor parallel checks -----------------------------------------------------------------------------
    def check_tp(self, config, tp_size: int) -> None:
        """Refuse a tp_size that does not divide the sizes it splits, naming the number and the valid sizes."""
        check_divisible(config, tp_size, self.tp_divisible)


def check_divisible(config, tp_size: int, attrs: Sequence[str]) -> None:
    """Refuse a tp_size that does not divide the `config` attributes `attrs`, naming the number and the valid sizes."""
    if tp_size == 1:
        return
    values = {attr: getattr(config, attr) for attr in attrs if getattr(config, attr, None)}
    bad = {k: v for k, v in values.items() if v % tp_size}
    if bad:
        common = math.gcd(*values.values())
        valid = [d for d in range(1, common + 1) if common % d == 0]
        raise ValueError(f"tp_size={tp_size} does not divide {', '.join(f'{k}={v}' for k, v in bad.items())} of "
                         f"{type(config).__name__}; valid tp sizes for this model: {valid}.")


def _nearest(root: nn.Module, pattern: str) -> str:
    """Where `pattern` stops matching `root`'s modules: the deepest module its leading names match, and its children."""
    parts = pattern.split(".")
    paths = [n for n, _ in root.named_modules() if n]
    for k in range(len(parts) - 1, 0, -1):
        hit = next((p for p in paths if match(".".join(parts[:k]), p)), None)
        if hit is not None:
            return f"; '{hit}' has {[n for n, _ in root.get_submodule(hit).named_children()]}"
    return f"; it has {[n for n, _ in root.named_children()]}"

