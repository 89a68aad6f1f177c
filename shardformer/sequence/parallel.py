"""Sequence parallelism over the tp group, on an unmodified transformers model (applied by the Sharder).

From the first decoder layer's input to the last decoder layer's output (or the final norm's, when the model's
first exit module is a norm: its parameters are per-feature vectors) the hidden states are split along the
sequence over the tp ranks; everything before (embeddings, rotary tables, masks, positions, all computed by the
model's own forward on the full sequence) and after (head, loss) is as with tensor parallelism alone. A forward
pre-hook on the first layer keeps this rank's chunk (its gradient is all-gathered back) and a forward hook on the
last split module gathers the chunks (its gradient is split), and so the router logits mixture-of-experts layers
recorded on them, for the load-balancing loss (expert/router_logits.py); with pipeline parallelism the stages in between send
and receive the shard. Over a group of its own ("all_to_all", "ring_attn" with sp_size > 1) the LM head and the
model's own causal-LM loss then run on this rank's tokens again in a training forward with labels
(loss.py). Modes:

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

import functools
import re
import warnings
from typing import Any, Dict, List, NamedTuple, Optional

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from pipeline.context import Axis

from ..layer import ColumnParallelLinear, RowParallelLinear, gather_from_tp, split_to_tp
from ..layer.loss import TokenShard
from .ring_layout import zigzag_index
from ..layer.spec import get_tp_spec
from ..layer.replicated import sum_grad_over_tp
from ..policies.base import Colwise, Experts, KVHeads, Policy, Rowwise, SharedTailGrad, SplitParam
from ..policies.plan import Plan
from .ring import use_ring_attention
from ..expert.router_logits import replace_router_logits
from .loss import HeadOnShard, keep_split_through_head
from .ulysses import SEQUENCE_DIM, use_ulysses_attention

__all__ = ["SEQUENCE_PARALLEL_MODES", "SEQUENCE_DIM", "SequenceParallel", "SequenceSpan", "resolve_mode", "check_sequence_parallelism",
           "check_sequence_plan", "sequence_span", "apply_sequence_parallelism", "gather_tokens"]

SEQUENCE_PARALLEL_MODES = ("split_gather", "all_to_all", "ring_attn")


class SequenceParallel(NamedTuple):
    """The sequence parallelism a plugin's arguments ask for: `mode` (None: off) and `size`, the ranks of a group of
    its own (1: the tp group carries it)."""
    mode: Optional[str]
    size: int = 1

    @property
    def own_group(self) -> bool:
        return self.size > 1


def resolve_mode(enable: bool, mode: Optional[str], sp_size: Optional[int], tp_size: int,
                 warn_rank: int = 0) -> SequenceParallel:
    """The sequence parallelism HybridParallelPlugin's (ColossalAI's) arguments ask for; what cannot be done raises,
    naming the options (no collective: the same on every rank). ColossalAI's rules: "split_gather" (and "ring",
    which runs as split_gather here) use the tp group (needs tp_size > 1; sp_size is ignored); "all_to_all" and
    "ring_attn" use a group of `sp_size` ranks of their own (world = dp * pp * sp * tp; tp may be 1). Ours too:
    "all_to_all" with sp_size unset or 1 runs over the tp group, as before sp groups existed.

    Args:
        enable: `enable_sequence_parallelism`.
        mode: `sequence_parallelism_mode`; None means "all_to_all" when sp_size > 1 (ColossalAI's default), else
            "split_gather" over the tp group (ColossalAI would run "all_to_all" over one rank: no split at all).
        sp_size: the size of the sequence-parallel group of its own.
        tp_size: the tp group size.
        warn_rank: this process's rank; rank 0 warns.
    """
    if sp_size is not None and (isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1):
        raise ValueError(f"sp_size must be an integer >= 1, got {sp_size!r}.")
    size = sp_size or 1
    if not enable:
        if size > 1:
            raise ValueError(f"sp_size={sp_size} splits the sequence over a group of its own: also set "
                             f"enable_sequence_parallelism=True (as ColossalAI requires).")
        if mode is not None and warn_rank == 0:
            warnings.warn(f"sequence_parallelism_mode={mode!r} is ignored without enable_sequence_parallelism=True "
                          f"(as in ColossalAI).", stacklevel=3)
        return SequenceParallel(None)
    if mode is None:
        mode = "all_to_all" if size > 1 else "split_gather"
    if mode == "ring":
        if warn_rank == 0:
            warnings.warn("sequence_parallelism_mode='ring' (ColossalAI's split_gather with its all-gather overlapped "
                          "in a ring of point-to-point chunks) runs as 'split_gather' over the tp group: the same "
                          "results, the all-gather not overlapped.", stacklevel=3)
        mode = "split_gather"
    if mode not in SEQUENCE_PARALLEL_MODES:
        raise NotImplementedError(f"sequence_parallelism_mode={mode!r} is not supported; use 'split_gather' (Megatron-LM"
                                  f", over the tp group), 'all_to_all' (DeepSpeed-Ulysses) or 'ring_attn' (ring "
                                  f"attention; both over sp_size ranks of their own).")
    if mode == "split_gather":
        if size not in (1, tp_size) and warn_rank == 0:
            warnings.warn(f"sp_size={sp_size} is ignored by sequence_parallelism_mode='split_gather', which splits the "
                          f"sequence over the tp group (as in ColossalAI).", stacklevel=3)
        size = 1
    if mode == "ring_attn" and size == 1:
        raise ValueError("sequence_parallelism_mode='ring_attn' passes key/value blocks around a sequence-parallel "
                         "group of its own: set sp_size > 1.")
    if size == 1 and tp_size == 1:
        raise ValueError(f"enable_sequence_parallelism=True (sequence_parallelism_mode={mode!r}) splits the sequence "
                         f"over the tp group without sp_size, but tp_size=1: set tp_size > 1, or sp_size > 1 for "
                         f"'all_to_all' / 'ring_attn' over a group of their own.")
    return SequenceParallel(mode, size)


def check_sequence_parallelism(policy: Policy, mode: str, config: object, tp_size: int, sp_size: int = 1) -> None:
    """`check_sequence_plan` of a policy bound to its model (its plan)."""
    check_sequence_plan(policy.model, policy.plan(tp_size), mode, config, tp_size, sp_size)


def check_sequence_plan(model: nn.Module, plan: Plan, mode: str, config: object, tp_size: int,
                        sp_size: int = 1) -> None:
    """Refuse (the same on every rank, before any collective of the sharding) what the mode cannot split exactly,
    naming the model, the module or setting, and what to use instead. `sp_size` > 1: over a group of its own."""
    name = type(model).__name__
    if mode not in SEQUENCE_PARALLEL_MODES:
        raise ValueError(f"sequence_parallelism_mode={mode!r}: use one of {SEQUENCE_PARALLEL_MODES}.")
    if tp_size == 1 and sp_size == 1:
        raise ValueError("Sequence parallelism splits the sequence over the tp group (or sp_size ranks of its own): "
                         "it needs tp_size > 1 or sp_size > 1.")
    if plan.release is not None or getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"enable_sequence_parallelism: {name} is an encoder-decoder model (cross-attention "
                                  f"reads the other stack's full sequence), which is not supported; use "
                                  f"enable_sequence_parallelism=False.")
    if mode == "all_to_all" and sp_size > 1:
        _check_heads_split(name, config, tp_size, sp_size)
    if mode == "all_to_all":
        _check_no_per_head_parameters(model, plan, name, config)
    experts = {pattern for pattern, style in plan.tp_plan.items() if isinstance(style, Experts)}
    for pattern, style in plan.tp_plan.items():
        if not plan.inside_layers(pattern):
            continue
        if mode == "split_gather" and ((isinstance(style, Colwise) and style.gather_output)
                                       or (isinstance(style, Rowwise) and style.split_input)):
            _refuse_split_gather(f"{name}'s tp plan entry '{pattern}' ({style}) works on the full, replicated "
                                 f"sequence inside a layer")
        if mode == "split_gather" and isinstance(style, SharedTailGrad):
            _refuse_split_gather(f"{name} has multi-head latent attention ('{pattern}'), whose latent projections "
                                 f"read the gathered sequence outside the attention's entry")
        if mode == "all_to_all" and isinstance(style, SplitParam) and pattern.rpartition(".")[0] not in experts:
            raise NotImplementedError(f"sequence_parallelism_mode='all_to_all': {name} has per-head parameters "
                                      f"('{pattern}') its attention reads, which the heads exchange would not "
                                      f"split; use sequence_parallelism_mode='split_gather' or 'ring_attn'.")
        if mode == "all_to_all" and isinstance(style, KVHeads) and tp_size > 1:
            over = "tp" if sp_size == 1 else f"tp_size * sp_size = {tp_size * sp_size}"
            raise ValueError(f"sequence_parallelism_mode='all_to_all' splits the key/value heads over {over} ranks, "
                             f"but {name} has {style.num_heads} key/value heads for tp_size={tp_size}: use a tp size "
                             f"that divides {style.num_heads}, or sequence_parallelism_mode='split_gather'.")
    if mode == "split_gather":
        _check_mixers_are_regions(model, plan, name)


def _check_heads_split(name: str, config: object, tp_size: int, sp_size: int) -> None:
    """all_to_all over sp_size ranks exchanges each rank's heads (already 1/tp of them) for sequence: they must
    split evenly."""
    for attr in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and (heads % tp_size or (heads // tp_size) % sp_size):
            raise ValueError(f"sequence_parallelism_mode='all_to_all' exchanges heads for sequence over sp_size="
                             f"{sp_size} ranks, but {name} has {attr}={heads} for tp_size={tp_size}: "
                             f"tp_size * sp_size must divide it. Use another sp_size, or sequence_parallelism_mode="
                             f"'ring_attn' (any number of heads).")


def _check_no_per_head_parameters(model: nn.Module, plan: Plan, name: str, config: object) -> None:
    """all_to_all hands the model's attention function 1/sp of the heads: an attention module's own per-head
    parameter (one value per head, e.g. GPT-OSS's sinks), which that function reads whole, would not match them."""
    heads = getattr(config, "num_attention_heads", None)
    layers = plan.layer_list(model)
    if not isinstance(heads, int) or len(layers) == 0:
        return
    for path, module in layers[0].named_modules():
        if not _TOKEN_MIXERS.search(type(module).__name__):
            continue
        for param, p in module.named_parameters(recurse=False):
            if p.shape == (heads,):
                raise NotImplementedError(f"sequence_parallelism_mode='all_to_all': {name}'s attention "
                                          f"'{plan.layers}.*.{path}' reads a per-head parameter '{param}' whole, "
                                          f"which the heads exchange would not split; use sequence_parallelism_mode="
                                          f"'ring_attn'.")


def _refuse_split_gather(reason: str) -> None:
    raise NotImplementedError(f"sequence_parallelism_mode='split_gather': {reason}; use sequence_parallelism_mode="
                              f"'all_to_all' or no sequence parallelism.")


_TOKEN_MIXERS = re.compile(r"Attention|Attn|Mamba|Mixer|DeltaNet")  # transformers' names of token-mixing blocks


def _check_mixers_are_regions(model: nn.Module, plan: Plan, name: str) -> None:
    """split_gather gathers the sequence at the entry of a layer's tp regions only: a block of the layer that mixes
    tokens (an attention) without tp entries would see this rank's part of the sequence alone. Refuse it."""
    layers = plan.layer_list(model)
    if len(layers) == 0:
        return
    planned = [pattern for pattern, style in plan.tp_plan.items() if isinstance(style, Colwise)]
    for path, module in layers[0].named_modules():
        if not path or not _TOKEN_MIXERS.search(type(module).__name__):
            continue
        prefix = f"{plan.layers}.*.{path}."
        if not any(p.startswith(prefix) for p in planned):
            _refuse_split_gather(f"{name}'s '{plan.layers}.*.{path}' ({type(module).__name__}) mixes tokens but "
                                 f"has no tp plan, so it would see only this rank's part of the sequence")


class SequenceSpan(NamedTuple):
    """Where the sequence is split: from `first`'s input to `last`'s output; `norm` is the final norm inside the span
    (None when the span ends with the last layer)."""
    first: nn.Module
    last: nn.Module
    norm: Optional[nn.Module]


def sequence_span(model: nn.Module, plan: Plan) -> SequenceSpan:
    """The span of the unsharded model (call before the pipeline releases modules): the layers, and the first exit
    module too when it is a norm (parameters all 1-D: a LayerNorm/RMSNorm), which acts on each token alone."""
    layers = plan.layer_list(model)
    base = model.base_model
    norm = None
    if plan.exit:
        try:
            module = base.get_submodule(plan.exit[0])
        except AttributeError:
            module = None
        params = list(module.parameters()) if module is not None else []
        if params and all(p.dim() == 1 for p in params):
            norm = module
    return SequenceSpan(layers[0], norm if norm is not None else layers[len(layers) - 1], norm)


def apply_sequence_parallelism(model: nn.Module, plan: Plan, span: SequenceSpan, mode: str,
                               seq: Axis, own_group: bool = False,
                               parallel_output: bool = True) -> Optional[HeadOnShard]:
    """Split the sequence over the `seq` axis in `span`, on a model already sharded for tp; see the module
    docstring.

    Args:
        model: the sharded model (this stage's layers only).
        plan: its plan (`layers`, `base_prefix`).
        span: from `sequence_span` on the unsharded model (hooks act where this stage holds the modules).
        mode: "split_gather", "all_to_all" or "ring_attn".
        seq: the tp axis, or with `own_group` the sequence-parallel axis of its own (every parameter of the span,
            tensor-split or not, then sees this rank's part of the sequence: its gradient is summed over it).
        parallel_output: over a group of its own, the LM head and loss may run on this rank's tokens.

    Returns the split head's state where this stage keeps the sequence split through it (loss.py).
    """
    world, rank, group = seq.size, seq.rank, seq.group
    held: List[nn.Module] = list(plan.layer_list(model))
    zigzag = mode == "ring_attn"
    tokens = TokenShard(group, world, rank, zigzag)
    span.first.register_forward_pre_hook(_SplitSequence(group, world, rank, zigzag, "sp_size" if own_group else
                                                        "tp_size"), with_kwargs=True)
    span.last.register_forward_hook(_GatherSequence(tokens))
    # over a group of its own (all_to_all, ring_attn): the tp ranks of a head share their tokens, as the
    # vocab-parallel loss needs
    head = keep_split_through_head(model, tokens, parallel_output) if own_group else None
    if mode == "split_gather":
        prefix = plan.base_prefix + plan.layers + "."
        for path, module in model.named_modules():
            if path.startswith(prefix) and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.sequence_dim = SEQUENCE_DIM
    norm = [span.norm] if any(m is span.norm for m in model.modules()) else []  # (the last stage holds it)
    for module in held + norm:  # replicated parameters now see this rank's part of the sequence only
        for p in module.parameters():
            if own_group or get_tp_spec(p) is None:
                sum_grad_over_tp(p, group)
    if mode == "all_to_all":
        use_ulysses_attention(model, held, seq)
    elif mode == "ring_attn":
        use_ring_attention(model, held, seq)
    return head


# a no-grad call in train mode (generate, a metric between steps) splits the sequence as training does
_EVAL_HINT = (" Without gradients (generate, an evaluation) call model.eval() first: in eval mode the layers run on "
              "the whole sequence, any length.")


class _SplitSequence:
    """Forward pre-hook of the first layer: keep this rank's chunk of the hidden states (training mode); `zigzag`:
    its two chunks of 2 * world (ring attention's balanced layout)."""

    def __init__(self, group: ProcessGroup, world: int, rank: int, zigzag: bool = False,
                 size_name: str = "tp_size") -> None:
        self.group, self.world, self.rank, self.zigzag, self.size_name = group, world, rank, zigzag, size_name

    def __call__(self, module: nn.Module, args: tuple, kwargs: Dict[str, Any]):
        if not module.training:
            return None
        if args:
            return (self._split(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._split(kwargs["hidden_states"])}

    def _split(self, hidden: Tensor) -> Tensor:
        length = hidden.shape[SEQUENCE_DIM]
        multiple = 2 * self.world if self.zigzag else self.world
        if length % multiple:
            raise ValueError(f"enable_sequence_parallelism splits the sequence over {self.size_name}={self.world} ranks"
                             f"{' in 2 chunks each (ring_attn)' if self.zigzag else ''}, but this batch has sequence "
                             f"length {length}: pad the batch to a multiple of {multiple} (e.g. the tokenizer's "
                             f"pad_to_multiple_of={multiple}).{_EVAL_HINT if not torch.is_grad_enabled() else ''}")
        if self.zigzag:
            hidden = hidden.index_select(SEQUENCE_DIM, zigzag_index(length, self.world, hidden.device))
        return split_to_tp(hidden, SEQUENCE_DIM, self.group)


class _GatherSequence:
    """Forward hook of the span's last module: the full sequence again, in order (training mode); so are the router
    logits the forward has recorded (mixture of experts: expert/router_logits.py)."""

    def __init__(self, tokens: TokenShard) -> None:
        self.tokens = tokens

    def __call__(self, module: nn.Module, args: tuple, output: Any):
        if not module.training:
            return None
        shard = output[0] if isinstance(output, tuple) else output
        replace_router_logits(functools.partial(_gather_router_logits, tokens=self.tokens, batch=shard.shape[0],
                                                length=shard.shape[SEQUENCE_DIM]))
        if isinstance(output, tuple):
            return (gather_tokens(shard, self.tokens), *output[1:])
        return gather_tokens(shard, self.tokens)


def _gather_router_logits(logits: Tensor, tokens: TokenShard, batch: int, length: int) -> Tensor:
    """One router's logits of this rank's tokens ([batch * local length, experts], or [batch, local length,
    experts]) -> the whole sequence's, in the same layout and token order as one process's."""
    rows = logits.shape[:-1]
    if tuple(rows) not in ((batch * length,), (batch, length)):
        raise NotImplementedError(f"sequence parallelism gathers the router logits of this rank's {batch} x {length} "
                                  f"tokens, but a router recorded logits of shape {tuple(logits.shape)}, neither "
                                  f"[{batch * length}, experts] nor [{batch}, {length}, experts]; train this model "
                                  f"without sequence parallelism.")
    full = gather_tokens(logits.reshape(batch, length, logits.shape[-1]), tokens)
    return full.reshape(-1, full.shape[-1]) if len(rows) == 1 else full


def gather_tokens(shard: Tensor, tokens: TokenShard) -> Tensor:
    """The full sequence (dim 1), in order, from every rank's tokens (its gradient: this rank's tokens again)."""
    full = gather_from_tp(shard, SEQUENCE_DIM, tokens.group)
    if tokens.zigzag:
        order = zigzag_index(full.shape[SEQUENCE_DIM], tokens.world, full.device).argsort()
        full = full.index_select(SEQUENCE_DIM, order)
    return full
