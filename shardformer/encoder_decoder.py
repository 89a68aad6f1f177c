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

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .policies.base import Policy
from .stage import (INPUT, Released, ZeroEmbedding, _StageExit, _hidden_size, get_submodule_parent, held_layer_list,
                    replace_submodule, stand_in_for)


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


class EncoderDecoderPolicy(Policy):
    """A Policy for encoder-decoder models; subclasses fill in the class attributes (base-relative paths)."""

    encoder_layers: str = ""                           # e.g. "encoder.block"
    decoder_layers: str = ""
    encoder_entry: Dict[str, str] = {}                 # module -> stand-in kind where the encoder starts later
    decoder_entry: Dict[str, str] = {}
    encoder_exit: Sequence[str] = ()                   # run once, after the last encoder layer
    decoder_exit: Sequence[str] = ()                   # last stage only (with the LM head)
    entry_attributes: Dict[str, Dict[str, Any]] = {}   # stack -> attributes set where its entry is stood in
    carried: Dict[str, Tuple[int, int]] = {}           # value -> (layer's positional argument, layer output index)

    # -- structure over the two stacks ----------------------------------------------------------------------
    def _stack_sizes(self) -> Tuple[int, int]:
        if getattr(self, "_sizes", None) is None:
            base = self.model.base_model
            self._sizes = (len(base.get_submodule(self.encoder_layers)), len(base.get_submodule(self.decoder_layers)))
        return self._sizes

    def set_model(self, model: nn.Module) -> None:
        super().set_model(model)
        self._sizes = None

    def num_layers(self) -> int:
        return sum(self._stack_sizes())

    def layer_list(self) -> nn.ModuleList:
        """The (held) encoder layers followed by the (held) decoder layers."""
        base = self.model.base_model
        return nn.ModuleList([*base.get_submodule(self.encoder_layers), *base.get_submodule(self.decoder_layers)])

    def _bounds(self) -> List[int]:
        bounds = [0]
        for k in self.layers_per_stage():
            bounds.append(bounds[-1] + k)
        return bounds

    def _stage_of_layer(self, index: int) -> int:
        bounds = self._bounds()
        return next(s for s in range(len(bounds) - 1) if bounds[s] <= index < bounds[s + 1])

    def stage_of_param(self, name: str) -> Optional[Tuple[int, ...]]:
        n, prefix = self.stage_manager.num_stages, self.base_prefix
        n_enc = self._stack_sizes()[0]
        for layers, offset in ((self.encoder_layers, 0), (self.decoder_layers, n_enc)):
            if name.startswith(prefix + layers + "."):
                return (self._stage_of_layer(offset + int(name[len(prefix + layers) + 1:].split(".")[0])),)

        def under(paths) -> bool:
            return any(name.startswith(prefix + p + ".") for p in paths)
        if under(self.encoder_entry):
            return (0,)
        if under(self.decoder_entry):
            return (self._stage_of_layer(n_enc),)
        if under(self.encoder_exit):
            return (self._stage_of_layer(n_enc - 1),)
        if under(self.decoder_exit) or not name.startswith(prefix):
            return (n - 1,)
        return tuple(range(n))

    def get_held_layers(self) -> List[nn.Module]:
        """The modules owning parameters this rank's stage holds."""
        owners = {name.rpartition(".")[0] for name, _ in self.model.named_parameters(remove_duplicate=False)
                  if self.stage_manager.stage in self.stage_of_param(name)}
        return [self.model.get_submodule(name) for name in sorted(owners)]

    # -- releasing what the stage does not hold -------------------------------------------------------------
    def release_unheld_layers(self) -> Optional["EncoderDecoderStage"]:
        """Prune the model to this stage (see the module docstring); the callable that runs the stage."""
        sm, base, prefix = self.stage_manager, self.model.base_model, self.base_prefix
        n_enc, n_dec = self._stack_sizes()
        start, end = sm.get_stage_index(self.layers_per_stage())
        stacks = ((self.encoder_layers, self.encoder_entry, self.encoder_exit, 0, n_enc),
                  (self.decoder_layers, self.decoder_entry, self.decoder_exit, n_enc, n_dec))
        stage_input, carry_into, exit_module, capture, exit_is_encoder = None, None, None, None, False
        skip_first: List[SkipFirstCall] = []
        for layers, entry, exit, offset, size in stacks:
            lo, hi = max(start - offset, 0), min(end - offset, size)
            held = lo < hi
            full = base.get_submodule(layers)
            stack = base.get_submodule(layers.rpartition(".")[0])
            if held and lo > 0:  # starts inside this stack: stand-ins for its entry, carried values into layer lo
                for path, kind in entry.items():
                    stand_in = self._replace(base, path, lambda m, kind=kind: SkipFirstCall(m) if kind == SKIP_FIRST
                                             else StageInput(*_hidden_size(m)) if kind == INPUT
                                             else stand_in_for(kind, m))
                    if isinstance(stand_in, StageInput) and kind == INPUT:
                        stage_input = stand_in
                    elif isinstance(stand_in, SkipFirstCall):
                        skip_first.append(stand_in)
                for attr, value in self.entry_attributes.get(layers.rpartition(".")[0], {}).items():
                    setattr(stack, attr, value)
                carry_into = full[lo]
            elif not held:  # the stack does not run here
                for path in entry:
                    self._replace(base, path, lambda m, path=path: Released(prefix + path))
            ends_stack = held and hi == size
            if not ends_stack:
                for path in exit:
                    self._replace(base, path, lambda m, path=path: Released(prefix + path))
            if held and not ends_stack:
                exit_module = full[hi - 1]
            if offset == 0 and ends_stack and not sm.is_last_stage():
                if end == n_enc:
                    exit_module, exit_is_encoder = stack, True  # leave with the encoder's output
                else:
                    capture = stack  # the decoder layers here need it; later stages get it too
            replace_submodule(base, layers, held_layer_list(full, range(lo, hi)))  # empty where not held
        if not sm.is_last_stage():
            for name in self.head_modules():
                setattr(self.model, name, Released(name))
        if sm.is_first_stage() and sm.is_last_stage():
            return None
        return EncoderDecoderStage(self.model, stage_input, carry_into, self.carried, exit_module, exit_is_encoder,
                                   capture, skip_first)

    @staticmethod
    def _replace(base: nn.Module, path: str, make) -> Optional[nn.Module]:
        parent, name = get_submodule_parent(base, path)
        original = getattr(parent, name, None)
        if original is None or isinstance(original, (Released, StageInput)):
            return None
        new = make(original)
        replace_submodule(base, path, new)
        return new


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
