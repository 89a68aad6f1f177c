"""Regional compilation (`HybridParallelPlugin(compile_layers=True)`): every decoder layer this rank holds is compiled
in place with torch's `nn.Module.compile` (torch.compile of the module's call, its hooks included), after sharding
and activation checkpointing, as torchtitan compiles per block. Layers of one class share the compiled code (dynamo
inlines nn.Module instances, whose parameters become graph inputs), so compile time is paid once per distinct layer
class and input shape. Off by default: compilation costs seconds to tens of seconds per layer class on a CPU and
changes results only by float reassociation (~1e-8 in fp32).

Collectives inside a compiled layer are traced into its graph: tensor parallelism's sums and gathers and sequence
parallelism's all-gathers, reduce-scatters and all-to-alls run as torch's functional collectives there
(shardformer/layer/comm_traced.py; gloo on CPU, NCCL on CUDA), eager code keeps its own (layer/comm.py). What
stays eager is a graph break, each at a boundary of the layer's computation. Graph breaks per decoder layer
(Llama / Qwen3-MoE, fp32, no dropout; tests/test_regional_compile.py asserts no others):

- world of one, tp=2, split_gather sp (tp=2), all_to_all sp (sp=2): 0 (one graph per layer).
- ring_attn sp: 1, the ring attention call (its point-to-point ring and mask analysis run eagerly between the
  graph before it (norm, projections, rotary) and the one after (output projection, MLP)).
- ep: 2 break sites: the expert exchange's dispatch hook (all-to-alls whose row counts depend on the routing; its
  combine hook is eager too) and transformers' own router-logit capture (a ContextVar read, which breaks at a
  world of one too).
- pp: the last layer of a non-last stage has 1 more, its exit hook (after the layer's computation).
- dropout > 0 under tp or sp: 2 more around each module on sharded activations (swapping the RNG state in and out
  is not traceable); without dropout the swap is skipped inside compiled code (layer/dropout.py).
- activation checkpointing (transformers checkpoints the layer's forward with torch.utils.checkpoint, non-reentrant,
  which dynamo traces as a higher-order op into the layer's graph): no more breaks at a world of one, tp=2 (also
  x pp=2), split_gather and all_to_all sp. Inside the checkpoint the tp regions' hooks set and clear their
  `RegionSlot`s (shardformer/layer/region.py), objects made outside it: a side effect dynamo refuses there ("HOP:
  Unsafe side effect ... Attempted to mutate UserDefinedObjectVariable(RegionSlot)", a break at the checkpoint, and
  the layer ran eagerly) unless its `skip_fwd_side_effects_in_bwd_under_checkpoint` is on. `tracing_checkpoints()`
  turns it on, thread-locally, while the boosted model's forward runs (booster_plugin/core/parallel_module.py), where
  the layers are traced: the slots are set and cleared once in the forward, and the compiled backward recomputes
  from the graph, which holds all they carried (exact, as eager's replay). The body of a traced checkpoint must be
  one graph, so a checkpointed layer whose forward breaks anyway runs its checkpoint eagerly, the layer's
  computation inside it too (exact, without the compiled speed): ring sp (the ring attention call), ep and MoE
  models (the expert exchange; transformers' router-logit capture, at a world of one too), dropout > 0 under tp/sp
  (the RNG swap) and a zbv pipeline's weight-gradient store (both replayed in Python, activation_checkpoint.py).
  Compiling those would need the breaking calls traceable, or the layer's forward compiled inside an eager
  checkpoint. A layer first traced outside the boosted model's forward (`model.unwrap()(...)`) breaks at its
  checkpoint the same way.
"""
from __future__ import annotations

from typing import ContextManager, Sequence

import torch
from torch import nn

__all__ = ["compile_layers", "tracing_checkpoints"]


def compile_layers(layers: Sequence[nn.Module]) -> None:
    """Compile each layer in place (its forward runs compiled from the next call on)."""
    for layer in layers:
        layer.compile()


def tracing_checkpoints() -> ContextManager[None]:
    """Inside: dynamo traces a checkpointed layer whose forward sets Python state made outside the checkpoint (the tp
    regions' slots) into one graph, applying those side effects once in the forward (the module docstring)."""
    return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
