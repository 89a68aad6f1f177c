"""Ulysses attention (sequence parallelism "all_to_all", DeepSpeed-Ulysses): around the model's own attention
function, q/k/v are exchanged heads-for-sequence over the sequence-parallel group (each rank attends over the full
sequence with its share of the heads) and the output back; the rotary tables passed to the layers are cut to the
rank's chunk. Registered in transformers' AttentionInterface; the layers' modules read it from a config view."""
from __future__ import annotations

import copy
import sys
import weakref
from typing import Any, Callable, Dict, Optional, Protocol, Sequence, Tuple

from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils._pytree import tree_map_only

from pipeline.context import Axis

from ..config_view import see_config_while_running
from ..layer.comm import all_to_all

__all__ = ["SEQUENCE_DIM", "OwnAttention", "ShardPositionEmbeddings", "layers_config", "use_ulysses_attention", "point_layers_at", "own_attention"]

SEQUENCE_DIM = 1  # hidden states are (batch, sequence, hidden) in the models' layers
ULYSSES = "hybrid_parallel_ulysses"  # the attention implementation name the all_to_all layers' attention sees
# a transformers attention function: (module, query, key, value, attention_mask, **kwargs) -> (output, weights)
AttentionFunction = Callable[..., Tuple[Tensor, Optional[Tensor]]]


class _Ulysses:
    """What the Ulysses attention function needs of one attention module: the group and the attention function the
    module would have called (the model's own implementation name and its modeling file's eager function)."""

    def __init__(self, group: ProcessGroup, implementation: str, eager) -> None:
        self.group, self.implementation, self.eager = group, implementation, eager


def _ulysses_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """transformers attention function: q/k/v (batch, heads, sequence shard, head dim) are exchanged for (batch,
    heads / tp, full sequence, head dim), the module's own attention function runs with the full mask, and its
    output (batch, full sequence, heads / tp, head dim) is exchanged back to (batch, sequence shard, heads, head
    dim). In eval mode the layers are unsplit and the own function runs as is."""
    spec: _Ulysses = attention_override(module)
    attention = own_attention(module)
    if not module.training:
        return attention(module, query, key, value, attention_mask, **kwargs)
    query, key, value = (all_to_all(t, 1, 2, spec.group) for t in (query, key, value))
    output, weights = attention(module, query, key, value, attention_mask, **kwargs)
    return all_to_all(output, 1, 2, spec.group), weights


class ShardPositionEmbeddings:
    """Forward pre-hook of each layer: the rotary tables (`position_embeddings`, computed by the model on the full
    sequence) cut to this rank's part of the sequence (its contiguous chunk, or with `zigzag` its two chunks, as
    ring attention holds them), which its queries and keys are rotated with."""

    def __init__(self, world: int, rank: int, zigzag: bool = False) -> None:
        self.world, self.rank, self.zigzag = world, rank, zigzag

    def __call__(self, module: nn.Module, args: tuple, kwargs: Dict[str, Any]):
        hidden = args[0] if args else kwargs.get("hidden_states")
        tables = kwargs.get("position_embeddings")
        if not module.training or tables is None or hidden is None:
            return None
        chunk = hidden.shape[SEQUENCE_DIM]
        return args, {**kwargs, "position_embeddings": tree_map_only(Tensor, lambda t: self._cut(t, chunk), tables)}

    def _cut(self, table: Tensor, chunk: int) -> Tensor:
        full = table.dim() > SEQUENCE_DIM and table.shape[SEQUENCE_DIM] == chunk * self.world
        if not full:
            return table
        if self.zigzag:
            from .ring_layout import shard_zigzag
            return shard_zigzag(table, self.world, self.rank, dim=SEQUENCE_DIM)
        return table.narrow(SEQUENCE_DIM, self.rank * chunk, chunk)


def use_ulysses_attention(model: nn.Module, layers: Sequence[nn.Module], seq: Axis) -> None:
    """Point the layers' modules at a config view whose attention implementation is the Ulysses wrapper (the
    model's own config, and so its masks, are unchanged) and cut the rotary tables per layer."""
    point_layers_at(model, layers, ULYSSES, _ulysses_attention, "all_to_all",
                    lambda implementation, eager: _Ulysses(seq.group, implementation, eager),
                    ShardPositionEmbeddings(seq.size, seq.rank))


class OwnAttention(Protocol):
    """What a wrapping attention function keeps per module: the implementation the module would have called."""

    @property
    def implementation(self) -> str: ...
    @property
    def eager(self) -> Optional[AttentionFunction]: ...  # the modeling file's eager function, if it has one


# attention module -> its override (weak: a released module drops out with it)
_OVERRIDES: "weakref.WeakKeyDictionary[nn.Module, OwnAttention]" = weakref.WeakKeyDictionary()


def point_layers_at(model: nn.Module, layers: Sequence[nn.Module], name: str, function: AttentionFunction, mode: str,
                    make_spec: Callable[[str, Optional[AttentionFunction]], OwnAttention],
                    cut_tables: ShardPositionEmbeddings) -> None:
    """Register `function` as attention implementation `name` and point the layers' modules that read the model's
    config at a view naming it while they run (config_view.py; the model's own config, and so its masks, unchanged);
    each such module gets `make_spec(its implementation, its modeling file's eager function)` in the override
    registry (`_OVERRIDES`, keyed by module: nothing stays set on transformers' modules), and each layer the
    forward pre-hook `cut_tables` (the rotary tables cut to the rank's part of the sequence)."""
    from transformers import AttentionInterface

    config = layers_config(model, layers)
    implementation = config._attn_implementation
    view = copy.copy(config)
    object.__setattr__(view, "_attn_implementation_internal", name)  # no setter: it would recurse into sub-configs
    AttentionInterface.register(name, function)
    for layer in layers:
        layer.register_forward_pre_hook(cut_tables, with_kwargs=True)
        readers = [m for m in layer.modules() if getattr(m, "config", None) is config]
        if not readers:
            raise NotImplementedError(f"sequence_parallelism_mode={mode!r} replaces the attention implementation the "
                                      f"layers read from the model's config, but no module of {type(layer).__name__} "
                                      f"holds that config; use sequence_parallelism_mode='split_gather'.")
        for module in readers:
            eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if implementation == "eager" and eager is None:
                raise NotImplementedError(f"sequence_parallelism_mode={mode!r} wraps the model's attention "
                                          f"function, but {type(module).__name__} with attn_implementation='eager' "
                                          f"has none to wrap; load the model with attn_implementation='sdpa'.")
            see_config_while_running(module, view)
            _OVERRIDES[module] = make_spec(implementation, eager)


def layers_config(model: nn.Module, layers: Sequence[nn.Module]):
    """The config the layers' modules read (the model's; a vision-language model's text config)."""
    for layer in layers:
        for module in layer.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                return config
    return model.base_model.config


def own_attention(module: nn.Module):
    """The attention function the module would have called (its model's implementation)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    spec = attention_override(module)
    return ALL_ATTENTION_FUNCTIONS.get_interface(spec.implementation, spec.eager)


def attention_override(module: nn.Module) -> OwnAttention:
    """What point_layers_at registered for `module` (its sequence-parallel attention and own implementation)."""
    return _OVERRIDES[module]
