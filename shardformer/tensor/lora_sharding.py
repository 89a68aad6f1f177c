"""LoRA adapters (peft's `LoraLayer`) on tensor-parallel layers, sharded consistently with their base layer.

A peft LoRA layer computes `base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`. When the plan shards the module
it wraps, the sharder hands the whole LoRA layer here; its `base_layer` gets the plan's parallel layer as today and
the adapters follow it, so that peft's own forward (and its parameter names) stay untouched:
- base column-parallel (output split): `lora_A` replicated, `lora_B` split like the base's output (fused areas too).
  lora_A's weight gradient on each rank comes from its columns of lora_B only, so it is summed over tp (as the
  GradAllReduce style); the input `x` is copied to the tp region once for base and lora_A together, so its gradient
  (the partial sums of both) is all-reduced once.
- base row-parallel (input split): `lora_A` row-parallel (input split, output all-reduced), `lora_B` replicated.
Dropout on a replicated input draws the same mask on every tp rank, on a split input a mask per rank.
Embeddings, the vocab-parallel LM head, gathered outputs and LoRA variants (DoRA, ...) are refused: their adapters
would need other communication than the base layer's. So is a `modules_to_save` copy of a module the plan shards
(without tp, such copies train like any module).
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn
from torch.distributed import ProcessGroup

from pipeline.context import Axis

from ..layer.dropout import wrap_module_forward_in_local_rng, wrap_module_forward_in_shared_rng
from ..layer.linear import ColumnParallelLinear, RowParallelLinear
from ..layer.region import enter_region
from ..layer.replicated import sum_grads_over_tp
from ..layer.spec import TPSpec, shard_parameter
from .styles import Colwise, GradAllReduce, OwnHeads, Rowwise

__all__ = ["LoRAShardingError", "is_lora_layer", "is_modules_to_save", "native_module", "shards_adapters",
           "check_lora_layers", "shard_lora_layer"]


class LoRAShardingError(NotImplementedError):
    """A LoRA adapter sits on a module whose parallel style it cannot follow exactly; the message says which."""


def is_lora_layer(module: nn.Module) -> bool:
    """Is `module` a peft LoRA layer (a wrapper holding `base_layer` and the adapters)?"""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is optional: without it no module is one
        return False
    return isinstance(module, LoraLayer)


def is_modules_to_save(module: nn.Module) -> bool:
    """Is `module` peft's wrapper of a `modules_to_save` entry (the original module and a trainable full copy)?"""
    try:
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return False
    return isinstance(module, ModulesToSaveWrapper)


def native_module(module: nn.Module) -> nn.Module:
    """The module a plan entry shards: the base layer a LoRA layer wraps, the original module of a `modules_to_save`
    wrapper, else the module itself."""
    if is_lora_layer(module):
        return module.get_base_layer()
    return module.original_module if is_modules_to_save(module) else module


def _replaces(style) -> bool:
    """Does `style` replace the module (styles that keep it whole, replicated with summed gradients or OwnHeads, act on
    a wrapper as on any module)?"""
    return style is not None and not isinstance(style, (GradAllReduce, OwnHeads))


def shards_adapters(module: nn.Module, style) -> bool:
    """Is `module` a LoRA layer whose base layer `style` replaces (so the adapters must follow it here)?"""
    return is_lora_layer(module) and _replaces(style)


def check_lora_layers(model: nn.Module, style_of: Callable[[str], object]) -> None:
    """Refuse (LoRAShardingError naming the module, its style and the fix) LoRA layers that cannot follow their
    base layer's style (`style_of(path)`). Pure: called on every rank on the unsharded model, before any
    collective."""
    for path, layer in model.named_modules():
        style = style_of(path)
        if is_modules_to_save(layer) and _replaces(style):
            name = path.rpartition(".")[2]
            raise LoRAShardingError(f"LoraConfig.modules_to_save wraps '{path}' in a trainable full copy (peft's "
                                    f"ModulesToSaveWrapper), but tensor parallelism shards '{path}' as "
                                    f"{type(style).__name__}, which that copy cannot follow. Leave '{name}' out of "
                                    f"modules_to_save, or use tp_size=1 (pipeline and data parallelism keep the "
                                    f"module whole).")
        if shards_adapters(layer, style):
            _check_lora_layer(path, layer, style)


def _check_lora_layer(path: str, layer: nn.Module, style) -> None:
    fix = (f"Leave '{path.rpartition('.')[2]}' out of LoraConfig.target_modules (or use tp_size=1 for this "
           f"adapter).")
    if isinstance(style, Colwise) and style.gather_output:
        raise LoRAShardingError(f"LoRA on '{path}': its base layer gathers its column-parallel output "
                                f"(the LM head or a gathered projection); LoRA there is not supported. {fix}")
    if not isinstance(style, (Colwise, Rowwise)):
        raise LoRAShardingError(f"LoRA on '{path}': its base layer is sharded as {type(style).__name__} (a "
                                f"vocab-parallel embedding or LM head, or a split raw parameter); LoRA adapters "
                                f"only follow column- and row-parallel linear layers. {fix}")
    variants = sorted(getattr(layer, "lora_variant", {}) or {})
    embedding = list(getattr(layer, "lora_embedding_A", {}) or {})
    if variants or embedding or not len(layer.lora_A):
        what = f"LoRA variants ({', '.join(variants)}: DoRA and others)" if variants else "this kind of LoRA layer"
        raise LoRAShardingError(f"LoRA on '{path}': {what} cannot be sharded over tensor parallel (only plain "
                                f"LoRA on Linear/Conv1D layers). {fix}")


def shard_lora_layer(layer: nn.Module, style, tp: Axis, rng_tracker=None) -> None:
    """Shard a peft LoRA layer in place over the `tp` axis: its base layer by `style` (Colwise / Rowwise, as the plan
    says for the module it wraps) and every adapter consistently with it (see the module docstring)."""
    rank, world, group = tp.rank, tp.size, tp.group
    base = layer.get_base_layer()
    split_input = False
    if isinstance(style, Colwise):
        layer.base_layer = ColumnParallelLinear.from_native_module(base, tp, n_fused=style.n_fused)
        spec = TPSpec(0, style.n_fused, group=group)  # nn.Linear (out, in): lora_B's output split like the base's
        for name in layer.lora_A:
            sum_grads_over_tp(layer.lora_A[name], group)
            lora_b = layer.lora_B[name]
            lora_b.weight = shard_parameter(lora_b.weight, spec, rank, world)
            if lora_b.bias is not None:
                lora_b.bias = shard_parameter(lora_b.bias, spec, rank, world)
            lora_b.out_features = lora_b.weight.shape[0]
        hooks = _CopyInputOnce(group)
        layer.register_forward_pre_hook(hooks.pre, with_kwargs=True)
        layer.register_forward_hook(hooks.post)
    else:
        split_input = not style.split_input
        layer.base_layer = RowParallelLinear.from_native_module(base, tp, input_is_parallel=split_input)
        for name in layer.lora_A:
            layer.lora_A[name] = RowParallelLinear.from_native_module(layer.lora_A[name], tp,
                                                                      input_is_parallel=split_input)
    if rng_tracker is not None:
        wrap = wrap_module_forward_in_local_rng if split_input else wrap_module_forward_in_shared_rng
        for dropout in layer.lora_dropout.values():
            wrap(dropout, rng_tracker)


class _CopyInputOnce:
    """Forward hooks of a LoRA layer on a column-parallel base: base and lora_A read the same entered input. The
    sharder's region hook may have made it (`base.region_slot`, layer/region.py); otherwise the layer enters the
    tp region here (a copy, or with split_gather the gathered sequence), and the base's previous region input is
    restored after the layer's forward."""

    _UNSET = object()

    def __init__(self, group: Optional[ProcessGroup]) -> None:
        self.group = group
        self.previous = self._UNSET

    def pre(self, layer: nn.Module, args, kwargs):
        base = layer.base_layer
        x = args[0] if args else kwargs["x"]
        region = base.region_slot.region
        if region is None or not region.holds(x):
            self.previous = region
            region = enter_region(x, self.group, base.sequence_dim if base.training else None)
            base.region_slot.region = region
        entered = region.copied()
        if args:
            return (entered, *args[1:]), kwargs
        return args, {**kwargs, "x": entered}

    def post(self, layer: nn.Module, args, output) -> None:
        if self.previous is not self._UNSET:
            layer.base_layer.region_slot.region = self.previous
            self.previous = self._UNSET
