"""Run a transformers model's own forward as one pipeline stage.

Nothing of transformers' forward code is copied: a stage keeps the model and its own `forward`, and changes only
which submodules exist.
- Layers it does not hold are dropped from the layer list (held layers keep their HF index and name).
- On a non-first stage the embedding is a stand-in that returns zeros shaped like its output (other entry modules,
  e.g. GPT-2's position embedding, become zeros or identities), so masks and rotary embeddings are still built by
  the model itself from the real `input_ids` / `attention_mask`; the received hidden states replace the input of
  the stage's first layer (so whatever the model does between embedding and layers, e.g. scaling the embeddings,
  is not applied twice).
- On a non-last stage a forward hook on its last layer ends the forward with that layer's output; the final norm
  and head are released.
- A rank holding several chunks (interleaved, zero-bubble V) holds all their layers; a call names its chunk by the
  keyword `pipeline_chunk` (default 0) and runs the forward once with only that chunk's layers visible in the layer
  list, the real entry modules only for the first virtual stage (stand-ins otherwise) and the exit only for the last
  one.
- Router logits of mixture-of-experts models travel with the hidden states (key `pipeline_router_logits`), so the
  last stage's load-balancing loss sees every layer's, as one process's does (expert/router_logits.py).
- Inputs only the first virtual stage uses (a vision encoder's `pixel_values`: the policy's `first_stage_inputs`)
  are not passed to the others, whose encoder is released (`RELEASED`); every other input reaches every stage, so
  what the model computes from them (masks, M-RoPE positions from `image_grid_thw`) is computed alike on each.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence

import torch
from torch import nn

from ..config_view import config_swapped
from ..expert.router_logits import ROUTER_LOGITS, prepend_router_logits, recorded_router_logits

INPUT, ZEROS, IDENTITY = "input", "zeros", "identity"
RELEASED = "released"  # entry kind: never called off the first stage (its inputs are not passed there)
SHAPED = "shaped"  # entry kind: zeros shaped like the module's output (e.g. patch embeddings: pixels -> patches)
CHUNK_ARGUMENT = "pipeline_chunk"  # the keyword of a stage call that names the chunk to run


def _hidden_size(module: nn.Module) -> tuple[int, torch.dtype]:
    for p in module.parameters():
        if p.dim() == 2:
            return p.shape[-1], p.dtype
    raise ValueError(f"Cannot infer the hidden size of {type(module).__name__} for its pipeline stand-in.")


def _zeros_like_lookup(args, kwargs, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros shaped like the embedding lookup these call arguments ask for."""
    ids = args[0] if args else next((v for k, v in kwargs.items() if k in ("input_ids", "input")), None)
    if ids is None:
        ids = kwargs["inputs_embeds"][..., 0]
    return torch.zeros(*ids.shape, hidden_size, dtype=dtype, device=ids.device)


class ZeroEmbedding(nn.Module):
    """Stands in for an entry embedding on a non-first stage: zeros shaped like its lookup (masks and positions are
    still built from them; the received hidden states replace the first layer's input)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        # an empty buffer, so that model.to(dtype) also changes the dtype of the zeros this module returns
        self.register_buffer("dtype_ref", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return _zeros_like_lookup(args, kwargs, self.hidden_size, self.dtype_ref.dtype)


class ShapedZeros(ZeroEmbedding):
    """Stands in for an entry module whose output is not shaped like its input nor like a lookup (a patch embedding:
    pixels (batch, C, H, W) -> (batch, patches, hidden)): zeros shaped like the output of a parameter-free copy of it
    on the meta device, called with meta copies of the arguments. Attributes the model's forward reads from the
    module (e.g. `embeddings.patch_embeddings.projection.weight.dtype`) are read from that copy, which is kept out of
    the module tree (no parameters, no state)."""

    def __init__(self, original: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(0, dtype)
        object.__setattr__(self, "_on_meta", copy.deepcopy(original).to("meta"))

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            on_meta = self.__dict__.get("_on_meta")
            if on_meta is None:
                raise
            return getattr(on_meta, name)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        device = next(a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        meta = lambda a: a.to("meta") if isinstance(a, torch.Tensor) else a  # noqa: E731
        shape = _first_output(self._on_meta(*map(meta, args), **{k: meta(v) for k, v in kwargs.items()})).shape
        return torch.zeros(shape, dtype=self.dtype_ref.dtype, device=device)


def _first_output(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output
    return next(v for v in values if isinstance(v, torch.Tensor))


class Released(nn.Module):
    """Placeholder for a module held by another pipeline stage; calling it is a bug, so it says so."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"Module '{self.name}' is held by another pipeline stage and cannot run here.")


class HeldLayers(nn.ModuleList):
    """The layers one stage holds, under their original indices: `layers[5]` and the state_dict key `layers.5.*`
    mean the HF layer 5; iterating (or slicing, as the models' own loops do) yields the held layers in order —
    only those of the running chunk while `active` names them."""

    active: Optional[Sequence[str]] = None

    def _visible(self) -> List[nn.Module]:
        keys = self._modules if self.active is None else self.active
        return [self._modules[k] for k in keys]

    def indices(self) -> List[int]:
        """The HF indices of every held layer."""
        return [int(key) for key in self._modules]

    def __iter__(self):
        return iter(self._visible())

    def __len__(self) -> int:
        return len(self._visible())

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return nn.ModuleList(self._visible()[idx])
        key = str(idx)
        if key not in self._modules:
            raise IndexError(f"Layer {idx} is held by another pipeline stage; this stage holds layers "
                             f"{', '.join(self._modules)}.")
        return self._modules[key]


def held_layer_list(layers: nn.ModuleList, indices: Sequence[int]) -> HeldLayers:
    """Layers `indices` (ascending) of `layers`, keeping their indices (and so their parameter names)."""
    held = HeldLayers()
    for i in indices:
        held.add_module(str(i), layers[i])
    return held


class _StageExit(Exception):
    """Ends a non-last stage's forward with what it sends on."""

    def __init__(self, output: Dict[str, object]) -> None:
        super().__init__("pipeline stage output")
        self.output = output


def stage_output(layer_output: Any) -> Dict[str, object]:
    """What a non-last stage sends on, taken inside its forward: the last layer's hidden states, and the router
    logits recorded so far where the forward records them."""
    output = {"hidden_states": layer_output[0] if isinstance(layer_output, (tuple, list)) else layer_output}
    router_logits = recorded_router_logits()
    if router_logits is not None:
        output[ROUTER_LOGITS] = router_logits
    return output


class ChunkView(NamedTuple):
    """How the model looks while one chunk (virtual stage) of this rank runs."""
    layer_keys: Optional[Sequence[str]]  # its layers in the held list (None: all of them)
    entry_layer: Optional[nn.Module]     # its first layer: the received hidden states replace its input (None on
                                         # the first virtual stage)
    modules: Dict[str, nn.Module]        # model-relative path -> module to put there for this chunk
    exit_layer: Optional[nn.Module]      # ends the forward (None on the last virtual stage)
    config: object                       # the base model's config for this chunk (None: unchanged)


class StageForward:
    """Calls the (stage-pruned) model: feeds received hidden states, stops after the stage's last layer.

    Args:
        model: the sharded HF model.
        chunks: one view per chunk this rank holds.
        layers: the held layer list.
    """

    def __init__(self, model: nn.Module, chunks: Sequence[ChunkView], layers: HeldLayers,
                 first_stage_inputs: Sequence[str] = (), loop: Optional[nn.Module] = None) -> None:
        self.model, self.chunks, self.layers = model, list(chunks), layers
        self.first_stage_inputs = tuple(first_stage_inputs)
        self.loop = loop if loop is not None else model.base_model  # whose config a chunk's view replaces
        self._armed: Optional[nn.Module] = None
        self._value: Optional[torch.Tensor] = None
        self._router_logits: Optional[Sequence[torch.Tensor]] = None  # received with `_value`
        params = inspect.signature(model.forward).parameters
        self._extra = {"use_cache": False} if "use_cache" in params else {}
        for view in self.chunks:
            if view.exit_layer is not None:
                view.exit_layer.register_forward_hook(self._exit_hook)
            if view.entry_layer is not None:
                view.entry_layer.register_forward_pre_hook(self._entry_hook, with_kwargs=True)

    def _entry_hook(self, module, args, kwargs):
        value, self._value = self._value, None
        if value is None:  # not a stage call: leave the arguments alone (recomputation checkpoints `forward`, so it
            return None    # replays the substituted input)
        router_logits, self._router_logits = self._router_logits, None
        if router_logits is not None:
            prepend_router_logits(router_logits)
        if args:
            return (value, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": value}

    @torch.compiler.disable  # eager after a compiled layer (regional compilation): it ends the forward by raising
    def _exit_hook(self, module, args, output):
        if self._armed is module:  # disarmed during activation recomputation, which re-runs the layer in backward
            self._armed = None
            raise _StageExit(stage_output(output))

    def __call__(self, hidden_states: Optional[torch.Tensor] = None, pipeline_chunk: int = 0, **kwargs) -> Any:
        view = self.chunks[pipeline_chunk]
        router_logits = kwargs.pop(ROUTER_LOGITS, None)  # earlier stages' (expert/router_logits.py)
        if view.entry_layer is not None:
            for key in self.first_stage_inputs:
                kwargs.pop(key, None)
            if hidden_states is None:
                raise ValueError("This pipeline stage needs the previous stage's `hidden_states`.")
        with self.viewing(pipeline_chunk, hidden_states, router_logits):
            self._armed = view.exit_layer
            try:
                return self.model(**kwargs, **self._extra)
            except _StageExit as done:
                return done.output

    @contextlib.contextmanager
    def viewing(self, pipeline_chunk: int, hidden_states: Optional[torch.Tensor] = None,
                router_logits: Optional[Sequence[torch.Tensor]] = None) -> Iterator[None]:
        """Inside, the model looks as chunk `pipeline_chunk` sees it (its layers, entry stand-ins, config view) and
        its first layer takes `hidden_states` (received from the previous stage; None on the first virtual stage)."""
        view = self.chunks[pipeline_chunk]
        if view.entry_layer is not None:
            self._value, self._router_logits = hidden_states, router_logits
        restore = {path: self.model.get_submodule(path) for path in view.modules}
        for path, module in view.modules.items():
            replace_submodule(self.model, path, module)
        self.layers.active = view.layer_keys
        try:
            with config_swapped(self.loop, view.config):
                yield
        finally:
            self._armed = None
            self.layers.active = None
            for path, module in restore.items():
                replace_submodule(self.model, path, module)
            self._value = self._router_logits = None


def get_submodule_parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, name = path.rpartition(".")
    return (model.get_submodule(parent) if parent else model), name


def replace_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, name = get_submodule_parent(model, path)
    setattr(parent, name, new)


def stand_in_for(kind: str, original: nn.Module, path: str = "") -> nn.Module:
    if kind == IDENTITY:
        return nn.Identity()
    if kind == RELEASED:
        return Released(path)
    if kind == SHAPED:
        return ShapedZeros(original, next(original.parameters()).dtype)
    hidden, dtype = _hidden_size(original)
    return ZeroEmbedding(hidden, dtype)  # INPUT and ZEROS: the received hidden states enter at the first layer
