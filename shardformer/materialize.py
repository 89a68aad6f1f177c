"""Lazy initialization: a model built under `torch.device("meta")` costs no memory; after sharding only this rank's
shard is left, so allocating it then keeps the peak near the shard's size. A model built under `LazyInitContext`
carries `WeightSources` (lazy_sources.py): loaded lazily (`from_pretrained`), its checkpoint's tensors are read, this
rank's slice only, the others initialized as `from_pretrained` initializes missing keys; built from a config, every
tensor is eager init's, drawn again whole and sliced. A model built on meta without the context (or with
`per_rank_init=True`) gets per-rank draws of its own init."""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from pipeline.context import Axis

from .layer.conv1d import conv1d_class
from .layer.embedding import VocabParallelEmbedding
from .layer.linear import ColumnParallelLinear, RowParallelLinear
from .layer.replicated import grad_summed_over, sum_grad_over_tp
from .layer.spec import copy_tp_spec, get_tp_spec, zero_padding
from .lazy_sources import copy_tensor_marks, expert_rows_of, WeightSources, detach_sources, sources_of, tensor_names

__all__ = ["materialize"]


@torch.no_grad()
def materialize(model: nn.Module, device, tp: Axis, stage: int, init: bool = True) -> int:
    """Allocate the meta parameters and buffers `model` still holds (after sharding) on `device`.

    Tensors the model's `WeightSources` hold are filled from them (this rank's slice of the checkpoint tensor, or of
    eager init's), and the sources are dropped. With `init`, the other new tensors are initialized with the model's
    own `_init_weights` (HF's scheme; tensor-parallel layers through a native-class view of their shard, vocab
    padding zeroed; buffers such as rotary `inv_freq` recomputed), drawn per pipeline `stage` and rank of the `tp`
    axis (not eager init's draws): replicated parameters differ between tp ranks here, and the plugin's
    `sync_params` then broadcasts them over tp (and everything over dp). Non-meta tensors are left untouched. Returns
    the number of bytes allocated; 0 when nothing was on meta.
    """
    device = torch.device(device)
    sources = sources_of(model)
    names = tensor_names(model) if sources is not None else {}
    new_of: Dict[int, torch.Tensor] = {}
    from_checkpoint: List[Tuple[str, torch.Tensor]] = []  # (source name, new tensor)
    keep_alive: List[torch.Tensor] = []  # ids of replaced tensors must stay unique while new_of is in use
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for key, t in list(store.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in new_of:
                    new_of[id(t)] = _allocated(t, device)
                    keep_alive.append(t)
                    source = sources.find(names.get(id(t), ())) if sources is not None else None
                    if source is not None:
                        from_checkpoint.append((source, new_of[id(t)]))
                store[key] = new_of[id(t)]
    detach_sources(model)
    if not new_of:
        return 0
    loaded = {id(t) for _, t in from_checkpoint}
    fresh = {id(t) for t in new_of.values() if id(t) not in loaded}
    if init and fresh:
        _init_materialized(model, fresh, device, tp, stage)
    if from_checkpoint:
        _fill(sources, from_checkpoint, tp)
    return sum(t.numel() * t.element_size() for t in new_of.values())


def _fill(sources: WeightSources, targets: Sequence[Tuple[str, torch.Tensor]], tp: Axis) -> None:
    """This rank's shard of each source tensor, filled into its new tensor (vocab padding zeroed); the largest
    first (a source may hold a full tensor meanwhile: largest while little of the shard is written)."""
    rank, world = tp.rank, tp.size
    for name, t in sorted(targets, key=lambda target: -target[1].numel()):
        sources.fill(name, t.data, get_tp_spec(t), rank, world, expert_rows_of(t))


def _allocated(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor like the meta tensor `t` on `device`; a parameter keeps its attributes."""
    data = torch.empty(t.shape, dtype=t.dtype, device=device)
    if not isinstance(t, nn.Parameter):
        return data
    new = nn.Parameter(data, requires_grad=t.requires_grad)
    new.__dict__.update({k: v for k, v in t.__dict__.items() if k != "_is_hf_initialized"})
    copy_tp_spec(t, new)
    copy_tensor_marks(t, new)
    for summed_over in grad_summed_over(t):  # its gradient hooks stay with `t`
        sum_grad_over_tp(new, summed_over)
    return new


def _init_materialized(model: nn.Module, materialized: Set[int], device: torch.device, tp: Axis,
                       stage: int) -> None:
    """HF's per-module init (children before parents, like `initialize_weights`) on the new tensors only."""
    try:
        from transformers import PreTrainedModel
        from transformers import initialization as hf_init
        guard = hf_init.guard_torch_init_functions
    except ImportError:  # plain torch models: reset_parameters only
        PreTrainedModel, guard = None, None
    # other tensors are flagged as initialized, so HF's guarded init functions leave them alone
    flagged = list({id(t): t for m in model.modules() for t in (*m._parameters.values(), *m._buffers.values())
                    if t is not None and id(t) not in materialized and not getattr(t, "_is_hf_initialized", False)
                    }.values())  # once each: a tied weight sits in two modules
    for t in flagged:
        t._is_hf_initialized = True
    tp_rank = tp.rank
    # distinct draws per stage and tp rank (identical shards would make tp halves of a layer symmetric)
    seed = (torch.initial_seed() + 1_000_003 * stage + 7_919 * tp_rank) % (2 ** 63)
    devices = [device] if device.type not in ("cpu", "meta") else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"), \
                (guard() if guard is not None else contextlib.nullcontext()):
            torch.manual_seed(seed)
            _visit(model, None, materialized, PreTrainedModel)
    finally:
        for t in flagged:
            del t._is_hf_initialized
    tp_world = tp.size
    for p in model.parameters():  # vocab padding rows are zero, as sharding makes them
        if id(p) in materialized and get_tp_spec(p) is not None:
            zero_padding(p.data, get_tp_spec(p), tp_rank, tp_world)


def _visit(module: nn.Module, init_fn: Optional[Callable[[nn.Module], None]], materialized: Set[int],
           pretrained: Optional[type]) -> None:
    """Initialize `module`'s subtree, children first, each module holding new tensors by the init function of its
    nearest enclosing transformers model (`pretrained` instances), else by its own `reset_parameters`."""
    if pretrained is not None and isinstance(module, pretrained):
        init_fn = module._init_weights
    for child in module.children():
        _visit(child, init_fn, materialized, pretrained)
    if not any(id(t) in materialized for t in module.parameters()) and \
            not any(id(t) in materialized for t in module.buffers()):
        return
    if init_fn is not None:
        init_fn(_native_view(module))
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _native_view(module: nn.Module) -> nn.Module:
    """The module as HF's `_init_weights` knows it: a tensor-parallel layer becomes a shell of its native class
    (nn.Linear / transformers Conv1D / nn.Embedding) sharing its shard's parameters; others are returned as is."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        native = conv1d_class() if module.is_conv1d else nn.Linear
        shell = native.__new__(native)
        nn.Module.__init__(shell)
        shell.weight, shell.bias = module.weight, module.bias
        return shell
    if isinstance(module, VocabParallelEmbedding):
        shell = nn.Embedding.__new__(nn.Embedding)
        nn.Module.__init__(shell)
        shell.weight, shell.padding_idx = module.weight, module.local_padding_idx
        return shell
    return module
