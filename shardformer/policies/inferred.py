"""Policies inferred from a model's structure, for transformers families that declare no plans (OPT, GPT-J, ...).
The structure is read from one forward of a small twin of the model (proof/twin.py: same class and config flags, tiny
sizes); the policy is proven by another before it is used (proven.py, proof/prove.py), and refused if not exact.

- Layers: the ModuleList of same-class blocks with the most parameters (several large ones, e.g. an encoder's and a
  decoder's, are refused).
- Entry / exit: the modules with parameters beside the layer list (children of it and of its ancestors in the base
  model) called before the first layer / after the last one. Entry: the first embedding looking up an integer tensor
  is the stage input (a stand-in elsewhere), later ones give zeros, norms / projections / dropouts are identities, a
  module that changes its input's shape (ViT's patch embeddings: pixels -> patches) gives zeros of its output's; an
  embedding of something else (positions from a shape) has no stand-in and is kept by every stage (gradients summed).
  A module with parameters that runs among the layers (or both before and after them) is refused.
- Tensor parallel, per layer, from the order of its Linear / Conv1D calls: consecutive calls of one module's
  children on the same tensor (q, k, v; fc1; gate, up) are column-parallel when the next call reads their width and
  returns to the layer's width: that one is row-parallel (out_proj, fc2, down). A single fused projection is split in
  its areas where its name says how (`c_attn`, `qkv_proj`, `gate_up_proj`, ...: concatenated); `query_key_value` does
  not say whether it interleaves heads and is refused (BLOOM and Falcon have hand-written policies). Other Linears
  stay replicated, which is exact. Every layer must give the same plan.
- Attributes: integers counting heads (`num_heads`, `n_head`, ...) in the modules around a column/row pair, and in
  the module holding the column layers its widths of the split features (`embed_dim`, `all_head_size`,
  `split_size`, ...), are divided by tp. Tensors that module receives with a dimension per head (an ALiBi bias, a
  per-head mask: (batch, heads, ...), (batch * heads, ...) or (heads, ...)) reach it as the rank's heads' slice.
  Dropout modules between a pair act on split activations: per-rank masks.
- An embedding with a row per vocabulary entry is vocab-parallel, and so is a head Linear with an output per entry
  (tied weights are found by identity when sharding).

What the structure cannot show (a module reshaping with its input's full width, a norm over split features, a
convolution over split channels) the proof shows: such a plan is refused, naming the module.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

from torch import nn

from ..layer.conv1d import is_conv1d
from ..paths import base_prefix, match
from ..stage.forward import IDENTITY, INPUT, SHAPED, ZEROS
from ..tensor.styles import Colwise, Rowwise, VocabEmbedding, VocabHead
from ..tensor.split_heads_argument import SplitHeadsArgument
from ..proof.twin import BATCH, Call, build_twin, synthetic_batch, trace_calls
from .from_transformers import PlanRefused
from .proven import ProvenPolicy

__all__ = ["InferredPolicy", "infer_policy"]

# single fused projections whose areas are concatenated (name -> areas); names that do not tell the layout
FUSED = {"c_attn": 3, "qkv": 3, "qkv_proj": 3, "wqkv": 3, "w_pack": 3, "gate_up_proj": 2}
UNDECIDED = {"query_key_value"}


class InferredPolicy(ProvenPolicy):
    """A policy inferred from the model's structure (module docstring); proven by one forward when sharding."""

    source = "inferred"

    def __init__(self, **plan) -> None:
        super().__init__()
        for key, value in plan.items():
            setattr(self, key, value)

    def check_tp(self, config, tp_size: int) -> None:
        """Every split size of the real model (column outputs per fused area, row inputs, divided attributes) must
        divide by tp (the proof follows, in the sharder's prepare_plan)."""
        base = self.model.base_model
        for path, module in base.named_modules() if tp_size > 1 else ():
            style = next((s for p, s in self.tp_plan.items() if match(p, path)), None)
            sizes = {}
            if isinstance(style, Colwise) and _is_linear(module):
                sizes["output features per fused area"] = _features(module)[1] // style.n_fused
            elif isinstance(style, Rowwise) and _is_linear(module):
                sizes["input features"] = _features(module)[0]
            for pattern, attrs in self.tp_attributes.items():
                sizes.update({a: getattr(module, a) for a in attrs if match(pattern, path) and
                              isinstance(getattr(module, a, None), int)})
            bad = {k: v for k, v in sizes.items() if v % tp_size}
            if bad:
                raise ValueError(f"tp_size={tp_size} does not divide the {bad} of '{path}' "
                                 f"({type(module).__name__}) in {type(self.model).__name__}: use a tp size dividing "
                                 f"them.")
        super().check_tp(config, tp_size)


def infer_policy(model: nn.Module) -> InferredPolicy:
    """The plan of `model` read from its structure (module docstring); PlanRefused says why there is none."""
    name = type(model).__name__
    if not hasattr(model, "base_model") or not hasattr(model, "config"):
        raise PlanRefused(f"{name} is not a transformers model: no plan can be inferred.")
    try:
        twin = build_twin(model, tp=2)  # 4 heads (2 per tp rank): a head dim stands out from the others
        calls = trace_calls(twin, synthetic_batch(twin))
    except Exception as error:  # noqa: BLE001  (a config or head the twin cannot reproduce)
        raise PlanRefused(f"no plan can be inferred for {name}: a small twin of it does not run "
                          f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}).") from None
    prefix = base_prefix(twin)
    base = twin.base_model
    spans = _spans(calls, prefix)
    layers = _layer_list(base, name)
    try:
        entry, exit_ = _entry_exit(base, layers, spans, name)
        plan = _layer_plan(base, layers, spans, twin.config)
    except (KeyError, IndexError, AttributeError) as error:  # e.g. a module shared by several layers
        raise PlanRefused(f"no plan can be inferred for {name}: its layers '{layers}' do not run as a list of "
                          f"independent blocks ({type(error).__name__}: {error}).") from None
    vocab = getattr(twin.config, "vocab_size", None)
    tp_plan = {path: VocabEmbedding() for e in entry for path, m in _named(base, e)
               if isinstance(m, nn.Embedding) and m.num_embeddings == vocab}
    tp_plan.update(plan.tp)
    heads = {path: VocabHead() for child, m in twin.named_children() if prefix and not prefix.startswith(child + ".")
             for path, leaf in _named(twin, child) if _is_linear(leaf) and _features(leaf)[1] == vocab}
    return InferredPolicy(layers=layers, entry=entry, exit=exit_, tp_plan=tp_plan, head_tp_plan=heads,
                          tp_attributes=plan.attributes, tp_input_regions=plan.regions,
                          local_rng_modules=plan.local_rng, shared_rng_modules=())


class Span(NamedTuple):
    first: int      # index of its first call's start in the trace
    last: int       # index of its last call's end
    call: Call      # its first call
    output_shape: Optional[Tuple[int, ...]] = None  # its first call's output


def _spans(calls: List[Call], prefix: str) -> Dict[str, Span]:
    """Base-relative path -> when it ran."""
    spans: Dict[str, Span] = {}
    for i, c in enumerate(calls):
        if not c.path.startswith(prefix):
            continue
        rel = c.path[len(prefix):]
        if rel not in spans:
            spans[rel] = Span(i, i, c)
        elif not c.start:
            first_end = spans[rel].last == spans[rel].first
            spans[rel] = spans[rel]._replace(last=i, **({"output_shape": c.output_shape} if first_end else {}))
    return spans


def _named(root: nn.Module, path: str):
    """(path, module) of the module at `path` under `root` and of its descendants."""
    module = root.get_submodule(path)
    return [(f"{path}.{sub}" if sub else path, m) for sub, m in module.named_modules()]


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _features(module: nn.Module) -> Tuple[int, int]:
    """(in, out) features of an nn.Linear or a transformers Conv1D (weight (in, out))."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return tuple(module.weight.shape)


def _layer_list(base: nn.Module, name: str) -> str:
    lists = [(p, m) for p, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m) and _count(m)]
    outer = [(p, m) for p, m in lists if not any(p.startswith(q + ".") for q, _ in lists)]
    if not outer:
        raise PlanRefused(f"no plan can be inferred for {name}: {type(base).__name__} has no list of layers.")
    largest = max(_count(m) for _, m in outer)
    big = [p for p, m in outer if _count(m) * 4 >= largest]
    mixed = [p for p in big if len({type(x) for x in base.get_submodule(p)}) > 1]
    if mixed:
        kinds = sorted({type(x).__name__ for x in base.get_submodule(mixed[0])})
        raise PlanRefused(f"no plan can be inferred for {name}: its layer list '{mixed[0]}' mixes block classes "
                          f"({', '.join(kinds)}), whose plans may differ.")
    if len(big) != 1:
        raise PlanRefused(f"no plan can be inferred for {name}: {type(base).__name__} has several layer lists "
                          f"({', '.join(big)}), e.g. an encoder's and a decoder's; a pipeline needs a policy that "
                          f"says how they run.")
    return big[0]


def _entry_exit(base: nn.Module, layers: str, spans: Dict[str, Span], name: str):
    n = len(base.get_submodule(layers))
    begin, end = spans[f"{layers}.0"].first, spans[f"{layers}.{n - 1}"].last
    parts = layers.split(".")
    ancestors = [".".join(parts[:i]) for i in range(len(parts))]
    before, after = [], []
    for ancestor in ancestors:
        for child, module in base.get_submodule(ancestor).named_children():
            path = f"{ancestor}.{child}" if ancestor else child
            if path == layers or layers.startswith(path + "."):
                continue
            held = _count(module) > 0
            span = spans.get(path)
            if span is None:
                if held:
                    after.append((len(spans) + len(after), path))  # never called: the last stage keeps it
            elif span.last < begin and (held or isinstance(module, nn.Dropout)):
                before.append((span.first, path, module, span.call))
            elif span.first > end and held:
                after.append((span.first, path))
            elif held:
                raise PlanRefused(f"no plan can be inferred for {name}: '{path}' ({type(module).__name__}) runs "
                                  f"among the layers '{layers}' or both before and after them, so no pipeline "
                                  f"stage alone can hold it.")
    entry: Dict[str, str] = {}
    for _, path, module, call in sorted(before, key=lambda x: x[0]):
        if any(isinstance(m, nn.Embedding) for m in module.modules()):
            if call.integer_input:  # a lookup of ids (or of a mask): zeros shaped like it stand in elsewhere
                entry[path] = ZEROS if INPUT in entry.values() else INPUT
            # else (e.g. positions from a shape): no stand-in can be shaped; every stage keeps it (gradients summed)
        else:  # e.g. a norm: the identity elsewhere; a module changing the shape (patches of pixels): zeros so shaped
            shapes = [shape for _, shape in call.tensors[:1]]
            entry[path] = IDENTITY if shapes == [spans[path].output_shape] else SHAPED
    return entry, tuple(path for _, path in sorted(after))


class LayerPlan(NamedTuple):
    tp: Dict[str, object]
    attributes: Dict[str, Tuple[str, ...]]
    regions: Tuple[str, ...]
    local_rng: Tuple[str, ...]


def _layer_plan(base: nn.Module, layers: str, spans: Dict[str, Span], config) -> LayerPlan:
    """The tp plan of the layers (every layer's the same), as base-relative patterns."""
    plans = [_one_layer(base, f"{layers}.{i}", spans, config) for i in range(len(base.get_submodule(layers)))]
    if any(p != plans[0] for p in plans[1:]):
        i = next(i for i, p in enumerate(plans) if p != plans[0])
        raise PlanRefused(f"no plan can be inferred for {type(base).__name__}: its layers differ in structure "
                          f"(layer 0: {plans[0].tp}; layer {i}: {plans[i].tp}).")
    star = lambda sub: f"{layers}.*.{sub}" if sub else f"{layers}.*"  # noqa: E731
    one = plans[0]
    return LayerPlan({star(k): v for k, v in one.tp.items()}, {star(k): v for k, v in one.attributes.items()},
                     tuple(star(r) for r in one.regions), tuple(star(r) for r in one.local_rng))


def _one_layer(base: nn.Module, layer: str, spans: Dict[str, Span], config) -> LayerPlan:
    """Column / row pairs of one layer (layer-relative paths), the attributes they divide, the per-head arguments
    they slice, their input regions and the dropout modules between them."""
    inside = sorted(((s.first, p) for p, s in spans.items() if p.startswith(layer + ".")))
    linears = [p for _, p in inside if _is_linear(base.get_submodule(p))]
    width = config.hidden_size  # the layers' width: a row-parallel layer returns to it
    rel = lambda p: p[len(layer) + 1:]  # noqa: E731
    tp, attributes, regions, local = {}, {}, set(), set()
    j = 0
    while j < len(linears):
        group = [linears[j]]
        while j + len(group) < len(linears) and _parent(linears[j + len(group)]) == _parent(group[0]) and \
                spans[linears[j + len(group)]].call.input_id == spans[group[0]].call.input_id:
            group.append(linears[j + len(group)])
        j += len(group)
        name = group[0].rpartition(".")[2].lower()
        fused = FUSED.get(name, 1) if len(group) == 1 else 1
        if len(group) == 1 and name in UNDECIDED:
            raise PlanRefused(f"no plan can be inferred for {type(base).__name__}: its fused projection "
                              f"'{group[0]}' does not say whether its heads are interleaved ([q, k, v] per head) or "
                              f"concatenated ([all q, all k, all v]); write a policy (custom_policy=...).")
        if j >= len(linears):
            break
        row = linears[j]
        row_in, row_out = _features(base.get_submodule(row))
        if row_out != width or all(row_in * fused != _features(base.get_submodule(p))[1] for p in group):
            continue  # not a pair: the group stays replicated
        j += 1
        tp.update({rel(p): Colwise(n_fused=fused) for p in group})
        tp[rel(row)] = Rowwise()
        owner = _parent(group[0])  # e.g. the attention module: it reshapes the split outputs
        if len(group) > 1 and owner in spans and spans[owner].call.input_id == spans[group[0]].call.input_id:
            regions.add(rel(owner))
        region = _common_parent([_parent(p) for p in (*group, row)])
        found = _divided_attributes(base, region, owner if owner != layer else None, config, row_in)
        for p, attrs in found.items():  # (merged: a later pair's region may hold an earlier pair's module)
            key = rel(p) if p != layer else ""
            attributes[key] = tuple(sorted(set(attributes.get(key, ())) | set(attrs)))
        split = _per_head_arguments(base, owner, spans, _heads(config)) if owner != layer else None
        if split is not None:
            tp[rel(owner)] = split
        local.update(rel(p) for first, p in inside if spans[group[0]].first < first < spans[row].first
                     and isinstance(base.get_submodule(p), nn.Dropout))
    return LayerPlan(tp, attributes, tuple(sorted(regions)), tuple(sorted(local)))


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _common_parent(paths: List[str]) -> str:
    parts = [p.split(".") for p in paths]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)


def _heads(config) -> set:
    """The config's head counts (attention, key/value, decoder heads, ...)."""
    return {v for k, v in config.to_dict().items() if "head" in k and "dim" not in k and "size" not in k
            and isinstance(v, int) and not isinstance(v, bool) and v > 1}


def _divided_attributes(base: nn.Module, region: str, owner: Optional[str], config, width: int):
    """Base-relative path -> integer attributes tp divides: head counts in `region` and below; in `owner` (the
    module holding the column layers) also its widths of the split features (`embed_dim`, `all_head_size`, ...)."""
    heads, found = _heads(config), {}
    for path, module in _named(base, region):
        if _is_linear(module):
            continue
        attrs = set()
        for a, v in vars(module).items():
            if not isinstance(v, int) or isinstance(v, bool):
                continue
            low = a.lower()
            if "head" in low and "dim" not in low and "size" not in low and v in heads:
                attrs.add(a)
            elif path == owner and v == width and any(w in low for w in ("dim", "size", "embed", "split")) \
                    and not low.startswith("head") and v not in heads:
                attrs.add(a)
        if attrs:
            found[path] = tuple(sorted(attrs))
    return found


def _per_head_arguments(base: nn.Module, owner: str, spans: Dict[str, Span], heads: set):
    """A SplitHeadsArgument for the tensors `owner` receives with a dimension per head ((batch, heads, ...) or
    (batch * heads, ...), e.g. an ALiBi bias, a per-head mask), built for all heads outside it; None if none."""
    counts = {a: v for a, v in vars(base.get_submodule(owner)).items() if isinstance(v, int) and v in heads
              and "head" in a.lower() and "kv" not in a.lower() and "key_value" not in a.lower()}
    if not counts or owner not in spans:
        return None
    attr, n = next(iter(counts.items()))
    by_dim = {1: [], 0: []}
    for name, shape in spans[owner].call.tensors:
        if len(shape) >= 3 and shape[1] == n:
            by_dim[1].append(name)
        elif len(shape) >= 2 and shape[0] in (n, BATCH * n):
            by_dim[0].append(name)
    dim = 1 if by_dim[1] else 0
    return SplitHeadsArgument(tuple(by_dim[dim]), dim=dim, heads=attr) if by_dim[dim] else None
