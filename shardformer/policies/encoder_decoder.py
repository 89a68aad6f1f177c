"""A Policy for encoder-decoder models (T5, BART): the pipeline splits the encoder's layers followed by the decoder's
over the stages; the policy declares its own stage pruning (`release_unheld_layers`), whose stage runs the model's
own forward (see stage/encoder_decoder.py). An encoder-only model of such a family (T5EncoderModel) declares no
decoder stack: the pipeline splits the encoder's layers alone."""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from torch import nn

from ..stage.encoder_decoder import SKIP_FIRST, EncoderDecoderStage, SkipFirstCall, StageInput
from ..stage.layer_bounds import stage_of_layer
from ..stage.forward import (INPUT, Released, _hidden_size, get_submodule_parent, held_layer_list, replace_submodule,
                     stand_in_for)
from .base import Policy

__all__ = ["SKIP_FIRST", "EncoderDecoderPolicy"]


class _Stack(NamedTuple):
    """One stack of layers (the encoder's or the decoder's) in the pipeline's layer sequence."""
    layers: str                # base-relative path of its layer list
    entry: Dict[str, str]      # its entry modules -> stand-in kind
    exit: Sequence[str]        # its exit modules
    offset: int                # index of its first layer in the sequence
    size: int                  # its layers in the unsharded model


class EncoderDecoderPolicy(Policy):
    """A Policy for encoder-decoder models; subclasses fill in the class attributes (base-relative paths)."""

    encoder_layers: str = ""                           # e.g. "encoder.block"
    decoder_layers: str = ""                           # "": an encoder-only model of the family (T5EncoderModel)
    encoder_entry: Dict[str, str] = {}                 # module -> stand-in kind where the encoder starts later
    decoder_entry: Dict[str, str] = {}
    encoder_exit: Sequence[str] = ()                   # run once, after the last encoder layer
    decoder_exit: Sequence[str] = ()                   # last stage only (with the LM head)
    entry_attributes: Dict[str, Dict[str, object]] = {}  # stack -> attributes set where its entry is stood in
    carried: Dict[str, Tuple[int, int]] = {}           # value -> (layer's positional argument, layer output index)

    # -- structure over the two stacks ----------------------------------------------------------------------
    def layer_stacks(self) -> Tuple[int, int]:
        """(encoder, decoder) layers of the unsharded model."""
        base = self.model.base_model
        return (len(base.get_submodule(self.encoder_layers)),
                len(base.get_submodule(self.decoder_layers)) if self.decoder_layers else 0)

    def _stacks(self, sizes: Tuple[int, ...]) -> List[_Stack]:
        """The stacks the model has, encoder first, of the unsharded model's `sizes`."""
        n_enc, n_dec = sizes
        stacks = [_Stack(self.encoder_layers, self.encoder_entry, self.encoder_exit, 0, n_enc)]
        if self.decoder_layers:
            stacks.append(_Stack(self.decoder_layers, self.decoder_entry, self.decoder_exit, n_enc, n_dec))
        return stacks

    def layer_paths(self) -> Tuple[str, ...]:
        return (self.encoder_layers, self.decoder_layers) if self.decoder_layers else (self.encoder_layers,)

    def layer_list(self) -> nn.ModuleList:
        """The (held) encoder layers followed by the (held) decoder layers."""
        base = self.model.base_model
        return nn.ModuleList([layer for path in self.layer_paths() for layer in base.get_submodule(path)])

    def place_param(self, name: str, split: Tuple[int, ...], stacks: Tuple[int, ...]) -> Tuple[int, ...]:
        n, prefix = self.stage_manager.num_stages, self.base_prefix
        n_enc = stacks[0]
        for stack in self._stacks(stacks):
            path = prefix + stack.layers
            if name.startswith(path + "."):
                return (stage_of_layer(split, stack.offset + int(name[len(path) + 1:].split(".")[0])),)

        def under(paths) -> bool:
            return any(name.startswith(prefix + p + ".") for p in paths)
        if under(self.encoder_entry):
            return (0,)
        if under(self.decoder_entry):
            return (stage_of_layer(split, n_enc),)
        if under(self.encoder_exit):
            return (stage_of_layer(split, n_enc - 1),)
        if under(self.decoder_exit) or not name.startswith(prefix):
            return (n - 1,)
        return tuple(range(n))

    def get_held_layers(self) -> List[nn.Module]:
        """The modules owning parameters this rank's stage holds."""
        owners = {name.rpartition(".")[0] for name, _ in self.model.named_parameters(remove_duplicate=False)
                  if self.stage_manager.stage in self.stage_of_param(name)}
        return [self.model.get_submodule(name) for name in sorted(owners)]

    # -- releasing what the stage does not hold -------------------------------------------------------------
    def release_unheld_layers(self) -> Optional[EncoderDecoderStage]:
        """Prune the model to this stage (see the module docstring); the callable that runs the stage."""
        sm, base, prefix = self.stage_manager, self.model.base_model, self.base_prefix
        placement = self.stage_placement()
        n_enc = placement.stacks[0]
        start, end = sm.get_stage_index(list(placement.split))
        stage_input, carry_into, exit_module, capture, exit_is_encoder = None, None, None, None, False
        skip_first: List[SkipFirstCall] = []
        for layers, entry, exit, offset, size in self._stacks(placement.stacks):
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
