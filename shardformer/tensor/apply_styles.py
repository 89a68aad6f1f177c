"""The style table: what each tensor-parallel style does to the module a plan entry names — replace it by a
parallel layer, or hook it in place — and the raw parameters a plan names: split (SplitParam) or summed over tp
(GradAllReduce: a table every rank's heads use, e.g. SAM's relative positions). A LoRA layer whose base layer
a style replaces is sharded with its adapters (lora_sharding.py)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Type

from torch import nn
from torch.distributed import ProcessGroup

from pipeline.context import Axis

from ..layer.dropout import TPRNGTracker
from ..layer.embedding import VocabParallelEmbedding, vocab_parallel_lm_head
from ..layer.experts import split_experts
from ..layer.head_embedding import HeadParallelEmbedding
from ..layer.linear import ColumnParallelLinear, RowParallelLinear
from ..layer.loss import parallel_causal_lm_loss, vocab_parallel_cross_entropy
from ..layer.replicated import keep_own_heads, sum_grad_over_tp, sum_grads_over_tp, sum_tail_grad_over_tp
from ..layer.spec import TPSpec, padded_size, shard_parameter
from ..layer.vocab_split import shard_embedding_in_place
from .lora_sharding import shard_lora_layer, shards_adapters
from ..stage.forward import Released, get_submodule_parent, replace_submodule
from .styles import (Colwise, Experts, GradAllReduce, HeadEmbedding, OwnHeads, ParallelStyle, Rowwise, SharedTailGrad,
                     SplitParam, VocabEmbedding, VocabHead)

__all__ = ["TPContext", "STYLE_TABLE", "apply_styles", "computes_causal_lm_loss", "ParallelCausalLMLoss"]


@dataclass(frozen=True)
class TPContext:
    """What the styles need besides the module: the model (a vocab-parallel head sets its loss), the tp axis, the
    plugin's vocabulary options and the dropout RNG tracker (LoRA dropout)."""
    model: nn.Module
    tp: Axis
    vocab_multiple: int
    parallel_output: bool
    rng_tracker: Optional[TPRNGTracker]


# a style applied to a module: its replacement, or None when the module was changed in place
Applier = Callable[[nn.Module, ParallelStyle, TPContext], Optional[nn.Module]]


def _column(module: nn.Module, style: Colwise, ctx: TPContext) -> nn.Module:
    return ColumnParallelLinear.from_native_module(module, ctx.tp, gather_output=style.gather_output,
                                                   n_fused=style.n_fused)


def _row(module: nn.Module, style: Rowwise, ctx: TPContext) -> nn.Module:
    return RowParallelLinear.from_native_module(module, ctx.tp, input_is_parallel=not style.split_input)


def _grad_all_reduce(module: nn.Module, style: GradAllReduce, ctx: TPContext) -> None:
    sum_grads_over_tp(module, ctx.tp.group)


def _own_heads(module: nn.Module, style: OwnHeads, ctx: TPContext) -> None:
    keep_own_heads(module, style.num_heads, ctx.tp, style.tail)


def _shared_tail(module: nn.Module, style: SharedTailGrad, ctx: TPContext) -> None:
    sum_tail_grad_over_tp(module, style.features, ctx.tp.group)


def _experts(module: nn.Module, style: Experts, ctx: TPContext) -> None:
    split_experts(module, ctx.tp.group)


def _vocab_embedding(module: nn.Module, style: VocabEmbedding, ctx: TPContext) -> Optional[nn.Module]:
    if type(module).forward is not nn.Embedding.forward:  # its own forward (e.g. scaled) on local ids
        shard_embedding_in_place(module, ctx.tp, ctx.vocab_multiple)
        return None
    return VocabParallelEmbedding.from_native_module(module, ctx.tp, make_vocab_size_divisible_by=ctx.vocab_multiple)


def computes_causal_lm_loss(model: nn.Module) -> bool:
    """Whether the model's forward takes its loss from `self.loss_function` with causal-LM semantics (the only loss
    the vocab-parallel cross-entropy stands in for); a head computing its own (GPT-2's double heads, BERT's
    pre-training) or another loss type (a masked LM's) needs the full logits."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    forward = inspect.unwrap(type(model).forward)
    loss = LOSS_MAPPING.get(getattr(model, "loss_type", None) or "ForCausalLM")
    code = getattr(forward, "__code__", None)
    return code is not None and "loss_function" in code.co_names and loss is ForCausalLMLoss


def _vocab_head(module: nn.Module, style: VocabHead, ctx: TPContext) -> nn.Module:
    gather = style.gather_output or not ctx.parallel_output or not computes_causal_lm_loss(ctx.model)
    padded = padded_size(module.out_features, ctx.tp.size, ctx.vocab_multiple)
    head = vocab_parallel_lm_head(module, ctx.tp, gather_output=gather, padded_vocab=padded)
    if not gather:  # the model's own loss must then be the vocab-parallel cross-entropy
        head.gather_output_in_eval = True
        ctx.model.loss_function = ParallelCausalLMLoss(ctx.tp.group, head.output_start, module.out_features)
    return head


def _head_embedding(module: nn.Module, style: HeadEmbedding, ctx: TPContext) -> nn.Module:
    return HeadParallelEmbedding(module, ctx.tp)


STYLE_TABLE: Dict[Type[ParallelStyle], Applier] = {
    Colwise: _column,
    Rowwise: _row,
    GradAllReduce: _grad_all_reduce,
    OwnHeads: _own_heads,
    SharedTailGrad: _shared_tail,
    Experts: _experts,
    VocabEmbedding: _vocab_embedding,
    VocabHead: _vocab_head,
    HeadEmbedding: _head_embedding,
}


def _applier(style: ParallelStyle, path: str) -> Applier:
    found = next((STYLE_TABLE[t] for t in type(style).__mro__ if t in STYLE_TABLE), None)
    if found is None:
        raise TypeError(f"Unknown parallel style {style!r} for {path}.")
    return found


def apply_styles(ctx: TPContext, style_of: Callable[[str], Optional[ParallelStyle]]) -> None:
    """Apply each module's style (`style_of(model-relative path)`) in place of `ctx.model`, then split the raw
    parameters a plan names (e.g. attention sinks, stacked experts; tables shared by split heads)."""
    model = ctx.model
    for path, module in list(model.named_modules()):
        style = style_of(path)
        if style is None or isinstance(module, Released) or not list(module.parameters()):
            continue
        if shards_adapters(module, style):
            shard_lora_layer(module, style, ctx.tp, ctx.rng_tracker)  # base layer and adapters, in place
            continue
        new = _applier(style, path)(module, style, ctx)
        if new is not None:
            replace_submodule(model, path, new)
    for name, p in list(model.named_parameters()):
        style = style_of(name)
        if isinstance(style, SplitParam):
            parent, attr = get_submodule_parent(model, name)
            spec = TPSpec(style.dim % p.dim(), style.n_fused, group=ctx.tp.group)
            setattr(parent, attr, shard_parameter(p, spec, ctx.tp.rank, ctx.tp.size))
        elif isinstance(style, GradAllReduce):
            sum_grad_over_tp(p, ctx.tp.group)


class ParallelCausalLMLoss:
    """`model.loss_function` for a vocab-parallel LM head: same semantics as transformers' ForCausalLMLoss."""

    def __init__(self, group: ProcessGroup, vocab_start: int, vocab_size: int) -> None:
        self.group, self.vocab_start, self.vocab_size = group, vocab_start, vocab_size

    def __call__(self, logits, labels, vocab_size=None, **kwargs):
        if logits.shape[-1] == self.vocab_size:  # eval mode: the head gathered the full logits
            from transformers.loss.loss_utils import ForCausalLMLoss
            return ForCausalLMLoss(logits, labels, vocab_size=self.vocab_size, **kwargs)
        return parallel_causal_lm_loss(logits, labels, vocab_size=self.vocab_size, tp_group=self.group,
                                       vocab_start=self.vocab_start, **kwargs)

    def token_losses(self, logits, targets, ignore_index: int = -100):
        """Per-token cross entropy of this rank's vocabulary columns `logits` (0 where ignored)."""
        return vocab_parallel_cross_entropy(logits, targets, self.group, self.vocab_start, ignore_index, "none",
                                            vocab_size=self.vocab_size)
