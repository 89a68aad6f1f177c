"""A policy derived from what transformers declares about a model: no per-model code (one of the policy
front-ends beside hand-written policies, Paddle-style plans and Parallelformers-style block policies).

- Pipeline: the model's `_pp_plan` (its config's `base_model_pp_plan` plus the head): the repeated module is the
  layer list, modules before it are the entry (first stage), modules after it the exit (last stage); modules
  outside the base model (LM head, classifier) belong to the last stage. A config without a pp plan gets one from
  the base model's structure (`structural_pp_plan`): its children with parameters in registration order around
  the one ModuleList the tp plan's `layers.*` patterns name.
- Tensor parallel: the model's `_tp_plan` (its config's `base_model_tp_plan`, the head, and the input embedding
  transformers adds; `declared_plans` completes an older release's plans likewise), each style name mapped onto
  our parallel layers (`STYLES`): column / row layers, raw parameters split like a Linear's weight (attention
  sinks, stacked experts), mixture-of-experts experts (`moe_tp_experts`), latent attention's shared rotary key
  (`mla_kv_a_proj`). A style we cannot honour exactly is refused, naming the module and the style, and so are
  config features a plan cannot honour (INEXACT_TP/PP).
- The rest comes from structure and config: tied weights are found by identity; a stage sees its own slice of
  `config.layer_types` (the models pick each layer's mask by its position in their loop); attention heads must
  split evenly.
"""
from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Dict, List, NamedTuple, Optional, Tuple

from torch import nn

from ..tensor.lora_sharding import native_module
from ..paths import base_prefix, find_submodule, match, split_at_base
from ..stage.forward import IDENTITY, INPUT
from ..stage.placement import StagePlacement
from ..tensor.styles import (Colwise, Experts, GradAllReduce, KVHeads, ParallelStyle, Rowwise, SharedTailGrad,
                             SplitParam, VocabEmbedding, VocabHead)
from .base import Policy, check_divisible
from .plan import Plan, per_layer
from .transformers_compat import declared_plans, kv_sharing_modes

# transformers' style names (5.x, plus the 4.x spellings) -> our style; None: nothing to do (replicated)
STYLES = {
    "colwise": Colwise(),
    "local_colwise": Colwise(),
    "colwise_gather_output": Colwise(gather_output=True),
    "colwise_rep": Colwise(gather_output=True),
    "packed_colwise": Colwise(n_fused=2),
    "rowwise": Rowwise(),
    "local_rowwise": Rowwise(),
    "rowwise_split_input": Rowwise(split_input=True),
    "rowwise_rep": Rowwise(split_input=True),
    "embedding_rowwise": VocabEmbedding(),
    "replicated_with_grad_allreduce": GradAllReduce(),
    "moe_tp_experts": Experts(),
    "replicate": None,
    "local_params": None,  # the module's parameters are plain local tensors: ours always are
}
# known styles we refuse, with the reason
REFUSED = {
    "moe_identity_expert": "identity (zero-computation) experts are not supported yet",
    "packed_rowwise": "packed row-wise layers are not supported yet",
    "all_reduce": "an all-reduce after a module (shared experts) is not supported yet",
    "embedding_colwise": "column-split embeddings are not supported yet",
}
_NEEDS = {Colwise: nn.Linear, Rowwise: nn.Linear, VocabEmbedding: nn.Embedding}
# config attributes with which a tp / pp plan is not exact when set (non-empty, not all zero), and why
INEXACT_TP = {
    "activation_sparsity_pattern": "its activation sparsity takes statistics over all intermediate features, "
                                   "which the plan's column-parallel gate projection splits over tp ranks",
}
INEXACT_PP = {
    "hidden_size_per_layer_input": "each layer reads its slice of the per-layer inputs by its position in the "
                                   "model's loop, which a stage's shorter layer list shifts",
}


class TPFit(NamedTuple):
    """A plan's tensor-parallel part fitted to one tp size."""
    tp_plan: Dict[str, ParallelStyle]
    attribute_values: Dict[str, Dict[str, object]]
    divisible: Tuple[str, ...]


class PlanRefused(NotImplementedError):
    """The model's plans cannot be honoured exactly; the message names the module and the reason."""


class UnsupportedStyle(PlanRefused):
    """A known tp style (REFUSED) this library cannot apply. It matters only where the model is tensor-split: the
    policy refuses it at tp_size > 1 (check_tp) and, with tp_size == 1, trains the model on the other axes."""


def style_of(name, path: str, head: bool, config=None):
    """Our style for a transformers style name (read defensively: case, spaces, unknown names)."""
    key = name.strip().lower() if isinstance(name, str) else None
    if key == "mla_kv_a_proj":  # latent attention: the shared rotary key (the output's last qk_rope_head_dim)
        rope = getattr(config, "qk_rope_head_dim", None)
        if not isinstance(rope, int) or rope <= 0:
            raise PlanRefused(f"tp plan of '{path}' uses style 'mla_kv_a_proj', whose shared rotary key has "
                              f"config.qk_rope_head_dim features; this config has none.")
        return SharedTailGrad(rope)
    if key in REFUSED:
        raise UnsupportedStyle(f"tp plan of '{path}' uses style '{name}': {REFUSED[key]}.")
    if key not in STYLES:
        raise PlanRefused(f"tp plan of '{path}' uses style {name!r}, which this library does not know; known: "
                          f"{', '.join(sorted(STYLES))}. Write a shardformer.Policy for this model "
                          f"(custom_policy=...).")
    style = STYLES[key]
    if head and isinstance(style, Colwise) and style.n_fused == 1:
        return VocabHead()  # the LM head: vocab-parallel (loss without gathering) or gathered, as the plugin says
    return style


class TransformersPlanPolicy(Policy):
    """Policy built from the model's own `_pp_plan` / `_tp_plan` (see the module docstring)."""

    def __init__(self, model: nn.Module, plans: Optional[Tuple[Dict, Dict]] = None) -> None:
        """`plans`: (pp plan, tp plan), model-relative, in place of the model's own `_pp_plan` / `_tp_plan`."""
        super().__init__()
        if not hasattr(model, "base_model") or not hasattr(model, "config"):
            raise PlanRefused(f"{type(model).__name__} is not a transformers model, so it has no plans.")
        self.set_model(model)
        prefix = base_prefix(model)
        pp_own, tp_own = plans or declared_plans(model)
        pp_plan = split_at_base(pp_own or {}, prefix)
        base_plan, head_plan = split_at_base(tp_own or {}, prefix)
        self.unsupported: Dict[str, str] = {}  # plan pattern -> why its style cannot be applied (tp > 1 only)
        self.tp_plan = self._styles(base_plan, False, model.config)
        self.head_tp_plan = self._styles(head_plan, True, model.config)
        names = list(pp_plan[0]) or structural_pp_plan(model.base_model, base_plan)
        self.layers, self.entry, self.exit = self._split_pipeline(model.base_model, names, pp_plan[0])
        self._split_raw_parameters(model.base_model)
        self._check_modules(model, prefix)
        columns = [p for p, s in self.tp_plan.items() if isinstance(s, Colwise)]
        self.tp_input_regions = tuple(sorted({p.rpartition(".")[0] for p in columns if "." in p}))
        self.local_rng_modules = tuple(sorted({p.rpartition(".")[0] for p, s in self.tp_plan.items()
                                               if isinstance(s, Colwise) and not s.gather_output and "." in p}))
        self.tp_plan.update(self._split_activation_params(model.base_model))
        config = model.config
        splits_heads = any(not s.gather_output for p, s in self.tp_plan.items() if isinstance(s, Colwise))
        self.tp_divisible = tuple(a for a in ("num_attention_heads", "num_key_value_heads")
                                  if splits_heads and all(isinstance(v, int) for v in _values(config, a)))

    def _styles(self, plan: Dict[str, object], head: bool, config) -> Dict[str, object]:
        """Our styles of a plan's entries (none for replicated ones); an UnsupportedStyle is kept aside."""
        styles = {}
        for pattern, name in plan.items():
            try:
                style = style_of(name, pattern, head, config)
            except UnsupportedStyle as refused:
                self.unsupported[pattern] = str(refused)
                continue
            if style is not None:
                styles[pattern] = style
        return styles

    def _split_pipeline(self, base: nn.Module, names: List[str], declared: Dict[str, Tuple[List[str], List[str]]]
                        ) -> Tuple[str, Dict[str, str], Tuple[str, ...]]:
        """(layer list, entry {path: stand-in kind}, exit paths). An entry module is the input embedding where the
        pp plan says it reads `input_ids` (whatever its class: a script may have replaced the nn.Embedding)."""
        lists = [i for i, n in enumerate(names) if isinstance(find_submodule(base, n), nn.ModuleList)]
        if len(lists) != 1:
            missing = [n for n in names if find_submodule(base, n) is None]
            raise PlanRefused(f"pipeline plan {names} of {type(base).__name__} has {len(lists)} layer lists; "
                              f"exactly one is needed" + (f" (the model has no {missing})" if missing else "") + ".")
        i = lists[0]
        reads_ids = lambda n: "input_ids" in (declared.get(n) or ((),))[0]  # noqa: E731
        entry = {n: INPUT if isinstance(native_module(find_submodule(base, n)), nn.Embedding) or reads_ids(n)
                 else IDENTITY for n in names[:i]}
        return names[i], entry, tuple(names[i + 1:])

    def _split_raw_parameters(self, base: nn.Module) -> None:
        """Plan entries naming a parameter, not a module: split like a Linear's weight (as transformers does):
        column-wise along dim -2 (per-head `sinks`: their only dim; stacked experts (E, out, in): out, in n_fused
        areas for gate|up), row-wise along dim -1."""
        params = list(base.named_parameters())
        for pattern, style in list(self.tp_plan.items()):
            found = [p for n, p in params if match(pattern, n)]
            if not found:
                continue
            if not isinstance(style, (Colwise, Rowwise)) or getattr(style, "gather_output", False) or \
                    getattr(style, "split_input", False):
                raise PlanRefused(f"tp plan of parameter '{pattern}' uses {style}, which raw parameters cannot take.")
            column = isinstance(style, Colwise)
            self.tp_plan[pattern] = SplitParam(-2 if column and found[0].dim() > 1 else -1,
                                               style.n_fused if column else 1)

    def _check_modules(self, model: nn.Module, prefix: str) -> None:
        """Every plan entry must name modules of the kind its style shards; one that does not (e.g. a module a
        script replaced with its own LoRA class) is kept aside as unsupported: refused at tp_size > 1 (check_tp,
        before any collective), irrelevant without tensor parallelism."""
        for plan, root in ((self.tp_plan, prefix), (self.head_tp_plan, "")):
            for pattern, style in plan.items():
                for path, module in model.named_modules():
                    if not path.startswith(root) or not match(pattern, path[len(root):]):
                        continue
                    if isinstance(style, SplitParam):
                        continue
                    need = _NEEDS.get(type(style), nn.Linear if isinstance(style, VocabHead) else nn.Module)
                    if not isinstance(native_module(module), need):  # a LoRA layer: the module it wraps
                        self.unsupported.setdefault(pattern, f"tp plan shards '{path}' ({type(module).__name__}) "
                                                             f"as {type(style).__name__}, which needs a "
                                                             f"{need.__name__}.")

    def _split_activation_params(self, base: nn.Module) -> Dict[str, GradAllReduce]:
        """Modules with parameters inside a region whose column layers split their outputs (e.g. a learnable
        activation between up and down projections) see only this rank's part: their gradients are summed. Not
        so on the region's replicated side: a Linear outside the plan (on split activations it would be
        row-parallel), or a module with a parameter dimension sized like a column layer's input (a router over
        the hidden states; the norm of a latent attention's low-rank projection, which feeds a column layer). A
        planned module's submodules (e.g. a LoRA layer's base layer and adapters) follow its style instead."""
        regions = [path for path, _ in _matching(base, self.local_rng_modules)]
        planned = [path for path, _ in _matching(base, self.tp_plan)]
        found = {}
        for region in regions:
            modules = [(p, m) for p, m in base.named_modules() if p.startswith(region + ".")
                       and not any(p.startswith(q + ".") for q in planned)]
            column_inputs = {native_module(m).in_features for p, m in modules
                             if isinstance(native_module(m), nn.Linear) and isinstance(self._style(p), Colwise)
                             and not self._style(p).gather_output}
            for path, module in modules if column_inputs else ():  # (e.g. a sparse MoE block without them)
                own = list(module.parameters(recurse=False))
                if not own or self._style(path) is not None or isinstance(module, nn.Linear) or \
                        any(size in column_inputs for p in own for size in p.shape):
                    continue
                found[path] = GradAllReduce()
        return found

    def _style(self, path: str):
        return next((s for p, s in self.tp_plan.items() if match(p, path)), None)

    def check_tp(self, config, tp_size: int) -> None:
        """As Policy.check_tp, on the plan fitted to `tp_size` (`fit_to_tp`). A config feature the plan cannot honour
        (INEXACT_TP), or a plan style we cannot apply, is refused."""
        if tp_size > 1 and self.unsupported:
            raise PlanRefused(f"{type(self.model).__name__} cannot be tensor-parallel: "
                              f"{next(iter(self.unsupported.values()))} Use tp_size=1: without tensor parallelism the "
                              f"style does not apply, and pipeline, data and expert parallelism do.")
        _refuse_features(self.model, INEXACT_TP if tp_size > 1 else {}, "tensor", "tp_size=1 (pipeline and data "
                         "parallel)")
        check_divisible(config, tp_size, self.fit_to_tp(config, tp_size).divisible)

    def tp_config(self):
        """The config whose heads the plan splits (check_tp's)."""
        return self.model.config

    def fit_to_tp(self, config, tp_size: int) -> TPFit:
        """The plan for `tp_size`: a heterogeneous config's per-layer head counts must all split (checked here, not
        by the config-wide check); with more tp ranks than key/value heads (a multiple of them), the key/value
        projections are replicated instead (KVHeads) and each attention repeats its kv head for fewer query
        heads. The policy itself is left as it is."""
        plan, values, divisible = dict(self.tp_plan), dict(self.tp_attribute_values), tuple(self.tp_divisible)
        per_layer = {a: _values(config, a) for a in divisible if len(_values(config, a)) > 1}
        if per_layer and tp_size > 1:  # a heterogeneous config: every layer's heads split evenly
            bad = {a: sorted(set(v)) for a, v in per_layer.items() if any(x % tp_size for x in v)}
            if bad:
                raise ValueError(f"tp_size={tp_size} does not divide the per-layer {bad} of "
                                 f"{type(config).__name__}; give a tp size dividing every layer's.")
            divisible = tuple(a for a in divisible if a not in per_layer)
        kv, heads = (_values(config, a) for a in ("num_key_value_heads", "num_attention_heads"))
        kv, heads = (v[0] if len(v) == 1 else None for v in (kv, heads))
        if "num_key_value_heads" in divisible and kv and heads and tp_size > kv and tp_size % kv == 0:
            divisible = tuple(a for a in divisible if a != "num_key_value_heads")
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            base = self.model.base_model
            for pattern, style in list(plan.items()):
                kv_modules = [m for _, m in _matching(base, (pattern,)) if isinstance(native_module(m), nn.Linear)
                              and native_module(m).out_features == kv * head_dim] if isinstance(style, Colwise) else []
                if kv_modules and not style.gather_output:
                    plan[pattern] = KVHeads(kv)
                    values[pattern.rpartition(".")[0]] = {"num_key_value_groups": heads // tp_size}
        return TPFit(plan, values, divisible)

    def plan(self, tp_size: int = 1) -> Plan:
        fit = self.fit_to_tp(self.tp_config(), tp_size)
        return replace(super().plan(tp_size), tp_plan=MappingProxyType(fit.tp_plan), tp_divisible=fit.divisible,
                       tp_attribute_values=MappingProxyType({k: MappingProxyType(v)
                                                             for k, v in fit.attribute_values.items()}))

    def stage_placement(self) -> StagePlacement:
        """As Policy's, refusing first (before the split is decided) a config feature the plan cannot honour
        across pipeline stages (INEXACT_PP)."""
        if self.stage_manager is not None and self.stage_manager.num_stages > 1:
            _refuse_features(self.model, INEXACT_PP, "pipeline", "pp_size=1 (tensor and data parallel)")
        return super().stage_placement()

    def check_split(self, split: List[int]) -> None:
        """Refuse a pipeline split (layers per stage; every rank decides the same one) that puts a layer reusing an
        earlier layer's keys/values (config.kv_sharing_modes: "reuse" reads the last "store" layer of its kind)
        on another stage than that layer.

        Args:
            split: layers of each stage, in order.
        """
        try:
            modes = kv_sharing_modes(self.model.config)
        except ValueError:
            return
        kinds = getattr(self.model.config, "layer_types", None) or [None] * len(modes)
        stage_of = [s for s, k in enumerate(split) for _ in range(k)]
        for i, mode in enumerate(modes[:len(stage_of)]):
            if mode != "reuse":
                continue
            producer = max((j for j in range(i) if modes[j] == "store" and kinds[j] == kinds[i]), default=None)
            if producer is not None and stage_of[producer] != stage_of[i]:
                raise PlanRefused(f"{type(self.model).__name__}: layer {i} reuses the keys/values of layer {producer} "
                                  f"(config.kv_sharing_modes), which the pipeline split {split} puts on another "
                                  f"stage; give num_layers_per_stage keeping layers {producer}..{i} on one stage.")

    def per_layer_config(self) -> Dict[str, Tuple[object, ...]]:
        # the models' loops pick a layer's mask (and rotary) by its position in the loop over the held layers
        # (a config computing layer_types from other fields, e.g. Jamba's periods, keeps them: not settable)
        return per_layer(self.model.config)


def _values(config, attr: str) -> List[object]:
    """[config.attr], or a heterogeneous config's per-layer values of it (reading it globally raises there)."""
    try:
        return [getattr(config, attr, None)]
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError
        return [getattr(layer, attr, None) for layer in config.per_layer_config]


def _refuse_features(model: nn.Module, features: Dict[str, str], kind: str, instead: str) -> None:
    """Refuse (on every rank alike) a config that sets one of `features` (attribute -> why it is not exact)."""
    for attr, why in features.items():
        value = getattr(model.config, attr, None)
        if value and (not isinstance(value, (list, tuple)) or any(value)):
            raise PlanRefused(f"{type(model).__name__} cannot be {kind}-parallel with config.{attr}={value!r}: "
                              f"{why}. Use {instead}.")


def structural_pp_plan(base: nn.Module, tp_plan: Dict[str, object]) -> List[str]:
    """A pipeline plan for a base model whose config declares none, from its structure: its children with parameters
    in registration order, around the one layer list (a ModuleList child the tp plan's `NAME.*.` patterns name).
    Refused unless an embedding comes before the list and none after it."""
    name = type(base).__name__
    lists = [n for n, m in base.named_children() if isinstance(m, nn.ModuleList) and len(m)
             and any(p.startswith(n + ".*.") for p in tp_plan)]
    if len(lists) != 1:
        raise PlanRefused(f"{name} declares no pipeline plan (config.base_model_pp_plan) and its layer list cannot "
                          f"be derived: the tp plan names {len(lists)} ModuleList children ({lists}); exactly one "
                          f"is needed.")
    names = [n for n, m in base.named_children() if n == lists[0] or next(m.parameters(), None) is not None]
    i = names.index(lists[0])
    embeds = [n for n in names if any(isinstance(m, nn.Embedding) for m in base.get_submodule(n).modules())]
    if not embeds or names.index(embeds[0]) > i or any(names.index(n) > i for n in embeds):
        raise PlanRefused(f"{name} declares no pipeline plan (config.base_model_pp_plan) and its structure does not "
                          f"give one: the modules registered around its layers '{lists[0]}' are {names}; an "
                          f"embedding must come before the layers and none after.")
    return names


def _matching(base: nn.Module, patterns) -> List[Tuple[str, nn.Module]]:
    return [(path, m) for path, m in base.named_modules() if any(match(p, path) for p in patterns)]

