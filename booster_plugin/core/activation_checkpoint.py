"""Activation checkpointing of the decoder layers inside each pipeline stage, through the model's own
`gradient_checkpointing_enable()` (transformers' GradientCheckpointingLayer, torch.utils.checkpoint non-reentrant).

transformers (5.24) checkpoints a layer's `forward`, not `__call__`, so module hooks on the layer (the pipeline
stage-exit hook) do not run again in the recomputation; older releases (5.17) checkpoint `__call__`, and there
`_replaying_forward_state` runs the hooks outside and checkpoints `forward` alone, the same thing. torch's
checkpoint restores the default RNG state (the dropout masks of replicated activations). What it cannot know is the
tensor-parallel tracker's private per-rank state (dropout on split heads, shardformer/layer/dropout.py) and the
weight-gradient store a zbv forward binds its linear layers to (pipeline/split_backward.py):
`_replaying_forward_state` replays the recomputation from the private state the forward started with (leaving the
tracker's progression untouched, so masks are identical) and under the same store (so it saves what the forward
saved). Inside a compiled layer (regional compilation) without a store, and without dropout under tp, there is
nothing to replay: the layer's forward is checkpointed as it is, and dynamo traces the checkpoint into the graph;
with something to replay, the checkpoint runs eagerly (a graph break; core/regional_compile.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import nn

from pipeline.split_backward import bound_store, deferring
from shardformer.layer.dropout import TPRNGTracker, has_dropout


@dataclass
class GradientCheckpointConfig:
    """How many held decoder layers each pipeline stage checkpoints (the first ones of the stage; with several model
    chunks per rank, a stage's layers are those of all its chunks).

    `num_ckpt_layers_per_stage` (one count per stage, like ColossalAI's PipelineGradientCheckpointConfig) wins;
    else `gradient_checkpointing_ratio` of each stage's layers (rounded down; ColossalAI's GradientCheckpointConfig).
    """
    gradient_checkpointing_ratio: float = 1.0
    num_ckpt_layers_per_stage: Optional[Sequence[int]] = None

    def check(self, pp_size: int) -> None:
        if not 0.0 <= self.gradient_checkpointing_ratio <= 1.0:
            raise ValueError(f"gradient_checkpoint_config: gradient_checkpointing_ratio="
                             f"{self.gradient_checkpointing_ratio} must be in [0, 1].")
        counts = self.num_ckpt_layers_per_stage
        if counts is not None and (len(counts) != pp_size or any(int(c) != c or c < 0 for c in counts)):
            raise ValueError(f"gradient_checkpoint_config: num_ckpt_layers_per_stage={list(counts)} must hold "
                             f"pp_size={pp_size} non-negative integers.")

    def num_ckpt_layers(self, stage: int, num_layers: int) -> int:
        if self.num_ckpt_layers_per_stage is not None:
            return int(self.num_ckpt_layers_per_stage[stage])
        return int(self.gradient_checkpointing_ratio * num_layers)


def _calls_module(function: Callable, layer: nn.Module) -> bool:
    """Whether `function` is `partial(nn.Module.__call__ of layer, ...)`: what older transformers (5.17) checkpoints
    (its GradientCheckpointingLayer.__call__), module hooks included, where later ones (5.24) checkpoint `forward`."""
    call = function.func if isinstance(function, functools.partial) else function
    return getattr(call, "__self__", None) is layer and getattr(call, "__func__", None) is nn.Module.__call__


def _replaying_forward_state(checkpoint_fn: Callable, tracker: Optional[TPRNGTracker], layer: nn.Module) -> Callable:
    dropping = has_dropout(layer)

    def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
        if _calls_module(function, layer):
            # the layer's hooks (a pipeline stage's entry substitutes the received input, its exit ends the stage)
            # run once, outside the checkpoint, and only `forward` is checkpointed, as transformers 5.24 does
            own = layer.__dict__.get("forward")
            forward = layer.forward
            layer.forward = lambda *a, **k: checkpoint(functools.partial(forward, **k), *a)
            try:
                return function(*args, **kwargs)
            finally:
                if own is None:
                    del layer.forward
                else:
                    layer.forward = own
        # the private RNG state this layer's forward starts from, and the weight-gradient store its linear layers
        # are bound to (zbv, pipeline/split_backward.py): the recomputation must save what the forward saved
        forward_state = tracker.local_states if tracker is not None else None
        store = bound_store()
        replays = store is not None or (tracker is not None and dropping)
        if torch.compiler.is_compiling() and not replays:
            # a compiled layer (regional compilation): nothing to replay, and the compiled backward recomputes from
            # its own graph (core/regional_compile.py)
            return checkpoint_fn(function, *args, **kwargs)
        calls = []

        def run(*a: Any, **k: Any) -> Any:
            calls.append(None)
            if len(calls) == 1:  # the forward itself
                return function(*a, **k)
            with deferring(store):  # the recomputation
                if tracker is None:
                    return function(*a, **k)
                progressed, tracker.local_states = tracker.local_states, forward_state
                try:
                    return function(*a, **k)
                finally:
                    tracker.local_states = progressed

        if torch.compiler.is_compiling():  # the replay is Python: the checkpoint runs eagerly (a graph break)
            return _eager_checkpoint(checkpoint_fn, run, *args, **kwargs)
        return checkpoint_fn(run, *args, **kwargs)

    return checkpoint


@torch.compiler.disable
def _eager_checkpoint(checkpoint_fn: Callable, function: Callable, *args: Any, **kwargs: Any) -> Any:
    """`checkpoint_fn(function, ...)` run eagerly from a compiled layer, `function` included."""
    return checkpoint_fn(function, *args, **kwargs)


def apply_activation_checkpointing(model: nn.Module, held_layers: Sequence[nn.Module], stage: int,
                                   layers_per_stage: List[int], config: Optional[GradientCheckpointConfig],
                                   tracker: Optional[TPRNGTracker]) -> None:
    """Checkpoint the first layers of this stage as `config` says (all held layers when the user enabled it on
    the model and gave no config); nothing when neither asks for it. Raises ValueError, the same on every rank,
    when a stage would checkpoint more layers than it holds."""
    enabled = any(getattr(layer, "gradient_checkpointing", False) for layer in held_layers)
    if config is None and not enabled:
        return
    config = config or GradientCheckpointConfig()
    counts = [config.num_ckpt_layers(s, n) for s, n in enumerate(layers_per_stage)]
    too_many = [(s, c, n) for s, (c, n) in enumerate(zip(counts, layers_per_stage)) if c > n]
    if too_many:
        raise ValueError("gradient_checkpoint_config asks stage(s) for more checkpointed layers than they hold: "
                         + ", ".join(f"stage {s}: {c} of {n}" for s, c, n in too_many) + ".")
    if not enabled:  # transformers 5.x: gradient_checkpointing_enable() is a deprecated alias of this
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    for i, layer in enumerate(held_layers):
        layer.gradient_checkpointing = i < counts[stage]
        if layer.gradient_checkpointing:
            layer._gradient_checkpointing_func = _replaying_forward_state(layer._gradient_checkpointing_func, tracker,
                                                                          layer)
