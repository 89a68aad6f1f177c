"""Encoder-decoder models (T5, BART) as pipeline stages, running the model's own forward.

The pipeline splits one sequence of layers, the encoder's followed by the decoder's, over the stages; a stage may
hold the last encoder layers and the first decoder layers. What a stage does with the model's forward:
- A stage that holds no encoder layer is given the encoder's output as `encoder_outputs` (the models' own way to
  skip the encoder); the encoder's modules are released there.
- A stage that starts inside a stack feeds the received hidden states through a stand-in for that stack's token
  embedding (other entry modules become zeros / identities; a module the stack calls both before and after its
  layers, T5's dropout, skips its first call) and the values the stack carries from layer to layer (T5's position
  bias, computed by the stack's first block) into its first held layer.
- A stage that ends inside a stack leaves after its last held layer with the hidden states and carried values;
  a stage that ends with the encoder leaves after the encoder with its output. From the end of the encoder on,
  every stage's output also holds `encoder_hidden_states`, which decoder stages use for cross-attention and pass on;
  their gradients flow back along the same path.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from .forward import ZeroEmbedding, _StageExit

__all__ = ["SKIP_FIRST", "StageInput", "SkipFirstCall", "EncoderDecoderStage"]


SKIP_FIRST = "skip_first"  # entry kind: the module's first call in a forward returns its input


class StageInput(ZeroEmbedding):
    """Stands in for a stack's embedding on a stage that starts inside it: its first call returns the received
    hidden states (a second lookup returns zeros: its contribution came with the hidden states)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__(hidden_size, dtype)
        self.value: Optional[torch.Tensor] = None

    def forward(self, *args, **kwargs) -> torch.Tensor:
        value, self.value = self.value, None
        return super().forward(*args, **kwargs) if value is None else value


class SkipFirstCall(nn.Module):
    """Stands in for a module a stack calls before its layers (already applied by the previous stage) and again
    after them: the first call of each forward returns its input, later calls run the module."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.called = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.called:
            self.called = True
            return x
        return self.module(x)


class EncoderDecoderStage:
    """Calls the stage-pruned encoder-decoder model with what the previous stage sent; returns what the next needs.

    Args:
        model: the pruned model.
        stage_input: stand-in of the embedding of the stack this stage starts inside (None: starts at a stack's
            beginning).
        carry_into: first held layer of that stack, which receives the carried values.
        carried: value name -> (positional argument of a layer call, index in a layer's output).
        exit_module: the module after which the stage leaves (a layer, or the encoder); None on the last stage.
        exit_is_encoder: the stage leaves after the encoder.
        capture: the encoder, when this stage runs its end and then decoder layers.
        skip_first: stand-ins whose first call in each forward is skipped.
    """

    def __init__(self, model: nn.Module, stage_input: Optional[StageInput], carry_into: Optional[nn.Module],
                 carried: Dict[str, Tuple[int, int]], exit_module: Optional[nn.Module], exit_is_encoder: bool,
                 capture: Optional[nn.Module], skip_first: Sequence[SkipFirstCall] = ()) -> None:
        self.model, self.stage_input, self.carried = model, stage_input, carried
        self.skip_first = list(skip_first)
        self.exit_is_encoder = exit_is_encoder
        self._armed = False
        self._received: Dict[str, torch.Tensor] = {}
        self._encoder_out: Optional[torch.Tensor] = None
        if carry_into is not None and carried:
            carry_into.register_forward_pre_hook(self._carry_hook)
        if exit_module is not None:
            exit_module.register_forward_hook(self._exit_hook)
        if capture is not None:
            capture.register_forward_hook(self._capture_hook)

    def _carry_hook(self, module, args):
        args = list(args)
        for name, (index, _) in self.carried.items():
            if name in self._received and len(args) > index and args[index] is None:
                args[index] = self._received.pop(name)
        return tuple(args)

    def _capture_hook(self, module, args, output):
        self._encoder_out = output[0]

    def _exit_hook(self, module, args, output):
        if not self._armed:  # disarmed during activation recomputation
            return
        self._armed = False
        if self.exit_is_encoder:
            raise _StageExit({"encoder_hidden_states": output[0]})
        out = {"hidden_states": output[0] if isinstance(output, (tuple, list)) else output}
        if isinstance(output, (tuple, list)):
            out.update({name: output[i] for name, (_, i) in self.carried.items() if output[i] is not None})
        if self._encoder_out is not None:
            out["encoder_hidden_states"] = self._encoder_out
        raise _StageExit(out)

    def __call__(self, hidden_states: Optional[torch.Tensor] = None,
                 encoder_hidden_states: Optional[torch.Tensor] = None, **kwargs) -> Any:
        from transformers.modeling_outputs import BaseModelOutput

        self._received = {name: kwargs.pop(name) for name in self.carried if name in kwargs}
        for module in self.skip_first:
            module.called = False
        if self.stage_input is not None:
            if hidden_states is None:
                raise ValueError("This pipeline stage needs the previous stage's `hidden_states`.")
            self.stage_input.value = hidden_states
        self._encoder_out = encoder_hidden_states
        if encoder_hidden_states is not None:
            kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=encoder_hidden_states)
        self._armed = True
        try:
            return self.model(**kwargs, use_cache=False)
        except _StageExit as done:
            return done.output
        finally:
            self._armed = False
            self._received = {}
            self._encoder_out = None
            if self.stage_input is not None:
                self.stage_input.value = None
