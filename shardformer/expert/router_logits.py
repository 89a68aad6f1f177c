"""Router logits of mixture-of-experts models across pipeline stages, so that the load-balancing loss is one
process's.

transformers' MoE models (Qwen2/3-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek, ...) record each router's logits with
`capture_outputs`: while the base model's forward runs, output-recorder hooks append every router's logits (one
[tokens, num_experts] tensor per MoE layer, in layer order) to the forward's collector, which becomes
`outputs.router_logits`; with `output_router_logits=True` the ...ForCausalLM forward then adds
`router_aux_loss_coef * load_balancing_loss_func(outputs.router_logits, ...)` to its loss. That loss is not a sum
over layers (it multiplies expert-assignment fractions by router probabilities, both averaged over all layers), so
under pipeline parallelism the last stage needs the logits of every layer, not only its own.

A stage therefore sends, with its hidden states, the router logits collected so far (the received ones followed by
its own layers'; key `ROUTER_LOGITS` of the stage's output, which the next stage's call receives as that keyword),
and the next stage puts the received ones at the front of its own forward's collector before its first layer runs.
On the last stage transformers itself then returns all layers' logits in `outputs.router_logits` and the model's own
loss function sees exactly what one process sees; autograd carries the gradient back through the P2P payload to the
routers of earlier stages. A forward that records no router logits (a dense model, `output_router_logits=False`)
sends nothing extra.

Families whose aux loss uses other per-layer statistics: none in transformers 5 for the decoder-only models pipeline
stages split (z-losses there, e.g. Bamba's, are on the LM logits of the last stage; Switch Transformers' and
NLLB-MoE's router z-losses are encoder-decoder models without a pipeline policy). DeepSeek-V3 records router logits
but computes no aux loss: the payload then only feeds `outputs.router_logits`.

Under sequence parallelism ("all_to_all", "ring_attn") each rank's routers see its part of the sequence only, and
the loss is not a sum of per-shard losses either (its fractions and mean probabilities are over all tokens, padding
excluded by the full attention mask). Where the split sequence is gathered again (the span's end,
sequence/parallel.py) every recorded logits tensor is therefore replaced by the whole sequence's, gathered over the
sp group in token order (`replace_router_logits`): the model's own loss function then sees one process's logits on
every sp rank, and the gather's backward hands each rank the gradient of its own tokens' logits (the routers'
weights, which saw this rank's tokens only, are summed over the group as every replicated parameter of the span).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from torch import Tensor
from transformers.utils import output_capturing

__all__ = ["ROUTER_LOGITS", "prepend_router_logits", "recorded_router_logits", "replace_router_logits"]

ROUTER_LOGITS = "pipeline_router_logits"  # payload key between stages, and the keyword of a stage call
_KEY = "router_logits"                    # transformers' `_can_record_outputs` key


def _collected() -> Optional[List[Tensor]]:
    """The running forward's list of recorded router logits (None: this forward records none)."""
    collector = getattr(output_capturing, "_active_collector", None)  # transformers' ContextVar of the forward
    outputs = collector.get() if collector is not None else None
    return outputs.get(_KEY) if isinstance(outputs, dict) else None


def recorded_router_logits() -> Optional[Tuple[Tensor, ...]]:
    """The router logits the running forward has collected so far (received ones first), in layer order; None
    when it records none. Called inside the model's forward (a layer's hook)."""
    collected = _collected()
    return None if collected is None else tuple(collected)


def prepend_router_logits(received: Sequence[Tensor]) -> None:
    """Put the router logits of earlier stages in front of what the running forward collects. Called inside the
    model's forward, before its first layer (a layer's pre-hook)."""
    collected = _collected()
    if collected is None:
        raise RuntimeError("This pipeline stage received the router logits of earlier stages, but its forward does "
                           "not record router logits (output_router_logits must be the same on every stage).")
    collected[:0] = list(received)


def replace_router_logits(transform: Callable[[Tensor], Tensor]) -> None:
    """Replace every router logits tensor the running forward has collected so far (received ones included) by
    `transform(it)`, in place; nothing when it records none. Called inside the model's forward (a layer's hook)."""
    collected = _collected()
    if collected:
        collected[:] = [transform(t) for t in collected]
