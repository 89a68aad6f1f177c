"""Sequence parallelism over the tp group, on an unmodified transformers model (applied by the Sharder).

From the first decoder layer's input to the last decoder layer's output (or the final norm's, when the model's
first exit module is a norm: its parameters are per-feature vectors) the hidden states are split along the
sequence over the tp ranks; everything before (embeddings, rotary tables, masks, positions, all computed by the
model's own forward on the full sequence) and after (head, loss) is as with tensor parallelism alone. A forward
pre-hook on the first layer keeps this rank's chunk (its gradient is all-gathered back) and a forward hook on the
last split module gathers the chunks (its gradient is split); with pipeline parallelism the stages in between send
and receive the shard. Modes:

- "split_gather" (Megatron-LM): weights split as with tp alone. Each column-parallel layer (or its tp region, e.g.
  the attention) all-gathers its input along the sequence and keeps only the shard for backward; each row-parallel
  layer reduce-scatters its output along the sequence instead of all-reducing it. Norms, residual additions and
  dropout outside the regions run on the shard.
- "all_to_all" (DeepSpeed-Ulysses): the decoder layers' weights are replicated over the group (not tensor-split);
  every module runs on the shard except attention itself, which exchanges heads for sequence with an all-to-all
  around the model's attention function (each rank attends over the full sequence with 1/tp of the heads) and
  back. The rotary tables passed to the layers are cut to the rank's chunk. Embeddings and LM head stay
  vocab-parallel.

Both are exact: the replicated parameters of the layers see only this rank's part of the sequence, so their
gradients are summed over the group; dropout inside the layers draws per-rank masks (the tp RNG tracker's private
state). Sequence parallelism is active in training mode; in eval mode (evaluation, `generate`, any length) the
layers run unsplit, as tensor parallelism alone (all_to_all: replicated layers).
"""
from __future__ import annotations

import copy
import re
import sys
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils._pytree import tree_map_only

from .layer import ColumnParallelLinear, RowParallelLinear, gather_from_tp, split_to_tp
from .layer.comm import all_to_all
from .layer.spec import get_tp_spec
from .layer.replicated import sum_grad_over_tp
from .policies.base import Colwise, KVHeads, Policy, Rowwise, SharedTailGrad, SplitParam

__all__ = ["SEQUENCE_PARALLEL_MODES", "SEQUENCE_DIM", "SequenceSpan", "resolve_mode", "check_sequence_parallelism",
           "inside_layers", "sequence_span", "apply_sequence_parallelism"]

SEQUENCE_PARALLEL_MODES = ("split_gather", "all_to_all")
SEQUENCE_DIM = 1  # hidden states are (batch, sequence, hidden) in the models' layers
ULYSSES = "hybrid_parallel_ulysses"  # the attention implementation name the all_to_all layers' attention sees


def resolve_mode(enable: bool, mode: Optional[str], sp_size: Optional[int], tp_size: int,
                 warn_rank: int = 0) -> Optional[str]:
    """The sequence parallelism mode that HybridParallelPlugin's (ColossalAI's) arguments ask for, None for none;
    what cannot be done raises, naming the options (no collective: the same on every rank).

    Args:
        enable: `enable_sequence_parallelism`.
        mode: `sequence_parallelism_mode`; None means "split_gather" (ColossalAI's plugin would pick "all_to_all"
            over an sp group of `sp_size` ranks, 1 by default: no split at all).
        sp_size: ColossalAI's separate sequence-parallel group size: only None or 1 (or tp_size with
            enable) are accepted, the sequence being split over the tp group.
        tp_size: the tp group size.
        warn_rank: this process's rank; rank 0 warns about a mode given without `enable`.
    """
    if sp_size not in (None, 1) and not (enable and sp_size == tp_size):
        raise NotImplementedError(f"sp_size={sp_size}: sequence parallelism over a group of its own is not "
                                  f"implemented; it runs over the tp group: use tp_size={sp_size} with "
                                  f"enable_sequence_parallelism=True (sequence_parallelism_mode 'split_gather' or "
                                  f"'all_to_all') and leave sp_size unset.")
    if not enable:
        if mode is not None and warn_rank == 0:
            warnings.warn(f"sequence_parallelism_mode={mode!r} is ignored without enable_sequence_parallelism=True "
                          f"(as in ColossalAI).", stacklevel=3)
        return None
    mode = "split_gather" if mode is None else mode
    if mode not in SEQUENCE_PARALLEL_MODES:
        raise NotImplementedError(f"sequence_parallelism_mode={mode!r} is not supported; use 'split_gather' "
                                  f"(Megatron-LM) or 'all_to_all' (DeepSpeed-Ulysses), both over the tp group "
                                  f"('ring' and 'ring_attn' are not implemented).")
    if tp_size == 1:
        raise ValueError(f"enable_sequence_parallelism=True (sequence_parallelism_mode={mode!r}) splits the sequence "
                         f"over the tp group, but tp_size=1: set tp_size > 1.")
    return mode


def inside_layers(policy: Policy, rel: str) -> bool:
    """Is the base-relative path `rel` (a module or parameter) inside the policy's layer list?"""
    return rel.startswith(policy.layers + ".")


def check_sequence_parallelism(policy: Policy, mode: str, config: Any, tp_size: int) -> None:
    """Refuse (the same on every rank, before any collective of the sharding) what the mode cannot split exactly,
    naming the model, the module or setting, and what to use instead."""
    name = type(policy.model).__name__
    if mode not in SEQUENCE_PARALLEL_MODES:
        raise ValueError(f"sequence_parallelism_mode={mode!r}: use one of {SEQUENCE_PARALLEL_MODES}.")
    if tp_size == 1:
        raise ValueError("Sequence parallelism splits the sequence over the tp group: it needs tp_size > 1.")
    if getattr(policy, "release_unheld_layers", None) is not None or getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"enable_sequence_parallelism: {name} is an encoder-decoder model (cross-attention "
                                  f"reads the other stack's full sequence), which is not supported; use "
                                  f"enable_sequence_parallelism=False.")
    for pattern, style in policy.tp_plan.items():
        if not inside_layers(policy, pattern):
            continue
        if mode == "split_gather" and ((isinstance(style, Colwise) and style.gather_output)
                                       or (isinstance(style, Rowwise) and style.split_input)):
            _refuse_split_gather(f"{name}'s tp plan entry '{pattern}' ({style}) works on the full, replicated "
                                 f"sequence inside a layer")
        if mode == "split_gather" and isinstance(style, SharedTailGrad):
            _refuse_split_gather(f"{name} has multi-head latent attention ('{pattern}'), whose latent projections "
                                 f"read the gathered sequence outside the attention's entry")
        if mode == "all_to_all" and isinstance(style, SplitParam):
            raise NotImplementedError(f"sequence_parallelism_mode='all_to_all': {name} has per-head parameters "
                                      f"('{pattern}') its attention reads, which the heads exchange would not "
                                      f"split; use sequence_parallelism_mode='split_gather'.")
        if mode == "all_to_all" and isinstance(style, KVHeads):
            raise ValueError(f"sequence_parallelism_mode='all_to_all' splits the key/value heads over tp ranks, but "
                             f"{name} has {style.num_heads} key/value heads for tp_size={tp_size}: use a tp_size "
                             f"that divides {style.num_heads}, or sequence_parallelism_mode='split_gather'.")
    if mode == "split_gather":
        _check_mixers_are_regions(policy, name)


def _refuse_split_gather(reason: str) -> None:
    raise NotImplementedError(f"sequence_parallelism_mode='split_gather': {reason}; use sequence_parallelism_mode="
                              f"'all_to_all' or no sequence parallelism.")


_TOKEN_MIXERS = re.compile(r"Attention|Attn|Mamba|Mixer|DeltaNet")  # transformers' names of token-mixing blocks


def _check_mixers_are_regions(policy: Policy, name: str) -> None:
    """split_gather gathers the sequence at the entry of a layer's tp regions only: a block of the layer that mixes
    tokens (an attention) without tp entries would see this rank's part of the sequence alone. Refuse it."""
    layers = policy.layer_list()
    if len(layers) == 0:
        return
    planned = [pattern for pattern, style in policy.tp_plan.items() if isinstance(style, Colwise)]
    for path, module in layers[0].named_modules():
        if not path or not _TOKEN_MIXERS.search(type(module).__name__):
            continue
        prefix = f"{policy.layers}.*.{path}."
        if not any(p.startswith(prefix) for p in planned):
            _refuse_split_gather(f"{name}'s '{policy.layers}.*.{path}' ({type(module).__name__}) mixes tokens but "
                                 f"has no tp plan, so it would see only this rank's part of the sequence")


class SequenceSpan(NamedTuple):
    """Where the sequence is split: from `first`'s input to `last`'s output; `norm` is the final norm inside the span
    (None when the span ends with the last layer)."""
    first: nn.Module
    last: nn.Module
    norm: Optional[nn.Module]


def sequence_span(policy: Policy) -> SequenceSpan:
    """The span of the unsharded model (call before the pipeline releases modules): the layers, and the first exit
    module too when it is a norm (parameters all 1-D: a LayerNorm/RMSNorm), which acts on each token alone."""
    layers = policy.layer_list()
    base = policy.model.base_model
    norm = None
    if policy.exit:
        try:
            module = base.get_submodule(policy.exit[0])
        except AttributeError:
            module = None
        params = list(module.parameters()) if module is not None else []
        if params and all(p.dim() == 1 for p in params):
            norm = module
    return SequenceSpan(layers[0], norm if norm is not None else layers[len(layers) - 1], norm)


def apply_sequence_parallelism(model: nn.Module, policy: Policy, span: SequenceSpan, mode: str,
                               group: ProcessGroup) -> None:
    """Split the sequence over `group` in `span`, on a model already sharded for tp; see the module docstring.

    Args:
        model: the sharded model (this stage's layers only).
        policy: its policy (`layers`, `base_prefix`).
        span: from `sequence_span` on the unsharded model (hooks act where this stage holds the modules).
        mode: "split_gather" or "all_to_all".
        group: the tp group.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    held: List[nn.Module] = list(policy.layer_list())
    span.first.register_forward_pre_hook(_SplitSequence(group, world, rank), with_kwargs=True)
    span.last.register_forward_hook(_GatherSequence(group))
    prefix = policy.base_prefix + policy.layers + "."
    for path, module in model.named_modules():
        if path.startswith(prefix) and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.sequence_dim = SEQUENCE_DIM
    norm = [span.norm] if any(m is span.norm for m in model.modules()) else []  # (the last stage holds it)
    for module in held + norm:  # replicated parameters now see this rank's part of the sequence only
        for p in module.parameters():
            if get_tp_spec(p) is None:
                sum_grad_over_tp(p, group)
    if mode == "all_to_all":
        _use_ulysses_attention(model, held, group, world, rank)


class _SplitSequence:
    """Forward pre-hook of the first layer: keep this rank's chunk of the hidden states (training mode)."""

    def __init__(self, group: ProcessGroup, world: int, rank: int) -> None:
        self.group, self.world, self.rank = group, world, rank

    def __call__(self, module: nn.Module, args: tuple, kwargs: Dict[str, Any]):
        if not module.training:
            return None
        if args:
            return (self._split(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._split(kwargs["hidden_states"])}

    def _split(self, hidden: Tensor) -> Tensor:
        length = hidden.shape[SEQUENCE_DIM]
        if length % self.world:
            raise ValueError(f"enable_sequence_parallelism splits the sequence over tp_size={self.world} ranks, but "
                             f"this batch has sequence length {length}: pad the batch to a multiple of "
                             f"{self.world} (e.g. the tokenizer's pad_to_multiple_of={self.world}).")
        return split_to_tp(hidden, SEQUENCE_DIM, self.group)


class _GatherSequence:
    """Forward hook of the span's last module: the full sequence again (training mode)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def __call__(self, module: nn.Module, args: tuple, output: Any):
        if not module.training:
            return None
        if isinstance(output, tuple):
            return (gather_from_tp(output[0], SEQUENCE_DIM, self.group), *output[1:])
        return gather_from_tp(output, SEQUENCE_DIM, self.group)


# -- all_to_all: Ulysses attention ----------------------------------------------------------------------------------
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
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    spec: _Ulysses = module.hybrid_parallel_ulysses
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(spec.implementation, spec.eager)
    if not module.training:
        return attention(module, query, key, value, attention_mask, **kwargs)
    query, key, value = (all_to_all(t, 1, 2, spec.group) for t in (query, key, value))
    output, weights = attention(module, query, key, value, attention_mask, **kwargs)
    return all_to_all(output, 1, 2, spec.group), weights


class _ShardPositionEmbeddings:
    """Forward pre-hook of each layer (all_to_all): the rotary tables (`position_embeddings`, computed by the model
    on the full sequence) cut to this rank's chunk, which its queries and keys are rotated with before the
    exchange."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank

    def __call__(self, module: nn.Module, args: tuple, kwargs: Dict[str, Any]):
        hidden = args[0] if args else kwargs.get("hidden_states")
        tables = kwargs.get("position_embeddings")
        if not module.training or tables is None or hidden is None:
            return None
        chunk = hidden.shape[SEQUENCE_DIM]
        return args, {**kwargs, "position_embeddings": tree_map_only(Tensor, lambda t: self._cut(t, chunk), tables)}

    def _cut(self, table: Tensor, chunk: int) -> Tensor:
        full = table.dim() > SEQUENCE_DIM and table.shape[SEQUENCE_DIM] == chunk * self.world
        return table.narrow(SEQUENCE_DIM, self.rank * chunk, chunk) if full else table


def _use_ulysses_attention(model: nn.Module, layers: Sequence[nn.Module], group: ProcessGroup, world: int,
                           rank: int) -> None:
    """Point the layers' modules at a config view whose attention implementation is the Ulysses wrapper (the
    model's own config, and so its masks, are unchanged) and cut the rotary tables per layer."""
    from transformers import AttentionInterface

    config = model.base_model.config
    implementation = config._attn_implementation
    view = copy.copy(config)
    object.__setattr__(view, "_attn_implementation_internal", ULYSSES)  # no setter: it would recurse into sub-configs
    AttentionInterface.register(ULYSSES, _ulysses_attention)
    for layer in layers:
        layer.register_forward_pre_hook(_ShardPositionEmbeddings(world, rank), with_kwargs=True)
        readers = [m for m in layer.modules() if getattr(m, "config", None) is config]
        if not readers:
            raise NotImplementedError(f"sequence_parallelism_mode='all_to_all' replaces the attention implementation "
                                      f"the layers read from the model's config, but no module of "
                                      f"{type(layer).__name__} holds that config; use "
                                      f"sequence_parallelism_mode='split_gather'.")
        for module in readers:
            eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if implementation == "eager" and eager is None:
                raise NotImplementedError(f"sequence_parallelism_mode='all_to_all' wraps the model's attention "
                                          f"function, but {type(module).__name__} with attn_implementation='eager' "
                                          f"has none to wrap; load the model with attn_implementation='sdpa'.")
            module.config = view
            module.hybrid_parallel_ulysses = _Ulysses(group, implementation, eager)

