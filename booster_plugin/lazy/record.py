"""Recording eager init while LazyInitContext builds a model from a config (`Model(config)`, `from_config`).

Inside the context every tensor is built on the meta device, and the recorder keeps what eager init (on the CPU)
would write into each one (tape.py): the aten ops the dispatcher sees on meta tensors (a `TorchDispatchMode`), the
calls of torch's init functions (`torch.nn.init.*`, which return at once on meta: each call is recorded whole), and
the data of `torch.tensor(...)` (which the meta device would drop). transformers skips `initialize_weights` on the
meta device: under the recorder it runs, as eager init runs it, in `post_init`.

Every call that draws random numbers also runs for real, right then, on a scratch CPU tensor of its full shape,
freed at once: the generators advance exactly as eager init advances them (the script's RNG after the context is
eager init's), and their states before the call are recorded, so that materialization can draw any tensor again
alone. At the end, each model built inside (a module that is no other's child) gets an `InitSources` of its
tensors by name (sources.py): `boost` fills each rank's slice from it (shardformer/materialize.py).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import warnings
import weakref
from itertools import chain
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.nn.modules import module as nn_module
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from shardformer.lazy_sources import attach_sources, sources_of

from .sources import InitSources
from .tape import Call, Node, Ref, Replay, view_of

__all__ = ["Recorder", "recording"]

_aten = torch.ops.aten
# in-place ops that write every element of their target without reading it (a restart of its tape when they cover
# its whole storage)
_OVERWRITE = {_aten.uniform_, _aten.normal_, _aten.random_, _aten.bernoulli_, _aten.exponential_, _aten.geometric_,
              _aten.cauchy_, _aten.log_normal_, _aten.fill_, _aten.zero_, _aten.copy_}
_INIT_NAMES = ("uniform_", "normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
               "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_", "sparse_")


def _is_meta(x: object) -> bool:
    return isinstance(x, Tensor) and x.is_meta


def _key(t: Tensor) -> int:
    return t.untyped_storage()._cdata


class Recorder(TorchDispatchMode):
    """Records, per meta storage built while active, its creation and writes (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: Dict[int, Node] = {}
        self.paused = 0
        self._scratch: Optional[torch.UntypedStorage] = None

    def scratch(self, ref: Ref) -> Tensor:
        """A CPU tensor of `ref`'s view whose values do not matter: on one storage, reused and grown (drawing into
        a fresh tensor each time would leave the freed ones in the C heap, fragmented: hundreds of MB for a 1 GB
        model)."""
        if self._scratch is None or self._scratch.nbytes() < ref.node.nbytes:
            self._scratch = None
            self._scratch = torch.empty(ref.node.nbytes, dtype=torch.uint8, device="cpu").untyped_storage()
        return view_of(self._scratch, ref)

    def close(self) -> None:
        self._scratch = None

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Nothing is recorded meanwhile (e.g. `from_pretrained`, which records its checkpoint instead)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def ref(self, t: Tensor) -> Ref:
        """`t` as a call sees it now; a storage built outside the recording becomes a node that cannot replay."""
        node = self.nodes.get(_key(t))
        if node is None:
            node = self.nodes[_key(t)] = Node(t.untyped_storage().nbytes(), None, False, t)
        return Ref(node, len(node.tape), t)

    def recorded(self, t: Tensor) -> Optional[Ref]:
        node = self.nodes.get(_key(t))
        return Ref(node, len(node.tape), t) if node is not None and node.known else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        inputs = [x for x in tree_flatten((args, kwargs))[0] if _is_meta(x)]
        refs = tree_map(lambda x: self.ref(x) if _is_meta(x) else x, (args, kwargs)) if inputs else (args, kwargs)
        out = func(*args, **kwargs)
        outs = tree_flatten(out)[0]
        if not inputs and not any(_is_meta(t) for t in outs):
            return out
        for t in inputs:  # resized in place (resize_): its record no longer describes it
            node = self.nodes.get(_key(t))
            if node is not None and t.untyped_storage().nbytes() != node.nbytes:
                node.known = False
        writes = _written(func, refs[0], refs[1])
        states = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            states = self._draw(func, refs, writes)
        call = Call(func, refs[0], refs[1], states, writes)
        known = self._append(call, refs, overwrite=func.overloadpacket in _OVERWRITE)
        for i, t in enumerate(outs):
            if _is_meta(t) and _key(t) not in self.nodes:
                self.nodes[_key(t)] = Node(t.untyped_storage().nbytes(), (call, i), known, t)
        return out

    def call_init(self, original: Callable, args: tuple, kwargs: dict) -> Tensor:
        """A torch init function called on a meta tensor: recorded whole, run on a scratch tensor for its draws."""
        flat = tree_flatten((args, kwargs))[0]
        if self.paused or not any(_is_meta(x) for x in flat):
            return original(*args, **kwargs)
        refs = tree_map(lambda x: self.ref(x) if _is_meta(x) else x, (args, kwargs))
        writes = tuple(r for r in tree_flatten(refs)[0] if isinstance(r, Ref))
        generator = next((g for g in flat if isinstance(g, torch.Generator)), None)
        states = (torch.get_rng_state(), generator.get_state() if generator is not None else None)
        with self.pause(), torch.device("cpu"), torch.no_grad():
            scratch = tree_map(lambda x: self.scratch(x) if isinstance(x, Ref) else x, refs)
            original(*scratch[0], **scratch[1])
        drew = not torch.equal(states[0], torch.get_rng_state()) or \
            (generator is not None and not torch.equal(states[1], generator.get_state()))
        self._append(Call(original, refs[0], refs[1], states if drew else None, writes), refs, overwrite=True)
        return next(x for x in flat if isinstance(x, Tensor))

    def _draw(self, func, refs, writes) -> tuple:
        """Run a random op for real (scratch for what it overwrites, replayed values for its other meta inputs):
        the generator it uses advances as in eager init. Returns the states before."""
        generator = refs[1].get("generator")
        states = (torch.get_rng_state(), generator.get_state() if generator is not None else None)
        replay = Replay()

        def real(x: object) -> object:
            if isinstance(x, Ref):
                if not x.node.known or (func.overloadpacket in _OVERWRITE and any(w is x for w in writes)):
                    return self.scratch(x)
                return view_of(replay.storage(x.node, x.version).clone(), x)
            return torch.device("cpu") if isinstance(x, torch.device) and x.type == "meta" else x

        args, kwargs = tree_map(real, refs)
        with torch.no_grad():
            func(*args, **kwargs)
        return states

    def _append(self, call: Call, refs, overwrite: bool) -> bool:
        """Put `call` on the tapes of the nodes it writes; False if it read a tensor without a record."""
        all_refs = [r for r in tree_flatten(refs)[0] if isinstance(r, Ref)]
        known = all(r.node.known for r in all_refs)
        for w in {id(w.node): w for w in call.writes}.values():
            node = w.node
            if not known:
                node.known = False
            reads_itself = any(r.node is node and r is not w for r in all_refs)
            if overwrite and w.covers() and not reads_itself:
                node.restarts.append(len(node.tape))
            node.tape.append(call)
        return known


def _written(func, args: tuple, kwargs: dict) -> tuple:
    """The `Ref`s among the arguments `func`'s schema says it writes into."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out.extend(r for r in tree_flatten(value)[0] if isinstance(r, Ref))
    return tuple(out)


class _DataOnCPU(TorchFunctionMode):
    """`torch.tensor(data)` and the like, which the meta device would leave without their data: built on the CPU,
    then moved to meta, a move the recorder keeps (with the data). Also with `device=` a meta tensor's device (as
    init code writes `device=module.weight.device`): eager init has the data there."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        onto_meta = (device is None or torch.device(device).type == "meta") and not self.recorder.paused and (
            (func in (torch.tensor, torch.as_tensor, torch.asarray) and not any(map(_is_meta, tree_flatten(args)[0])))
            or (func is Tensor.new_tensor and args and _is_meta(args[0]) and not any(map(_is_meta, args[1:]))))
        if not onto_meta:
            return func(*args, **kwargs)
        real = func(*args, **{**kwargs, "device": "cpu"})
        if any(isinstance(x, Tensor) and x.untyped_storage()._cdata == _key(real) for x in args):
            real = real.clone()  # as_tensor of a tensor: its data as it is now
        return real.detach().to("meta").requires_grad_(real.requires_grad)


@contextlib.contextmanager
def _init_functions(recorder: Recorder) -> Iterator[None]:
    """Every reference to torch's init functions (in modules already imported, and transformers' table of them)
    goes through the recorder meanwhile."""
    originals = {id(f): f for f in (getattr(torch.nn.init, name, None) for name in _INIT_NAMES) if f is not None}
    wrapped = {i: _wrap(recorder, f) for i, f in originals.items()}
    tables = [vars(m) for m in list(sys.modules.values()) if hasattr(m, "__dict__")]
    hf = sys.modules.get("transformers.initialization")
    if hf is not None and isinstance(getattr(hf, "TORCH_INIT_FUNCTIONS", None), dict):
        tables.append(hf.TORCH_INIT_FUNCTIONS)
    patched = []
    for table in tables:
        for key, value in list(table.items()):
            if value is not None and originals.get(id(value)) is value:
                table[key] = wrapped[id(value)]
                patched.append((table, key, value))
    try:
        yield
    finally:
        for table, key, value in patched:
            table[key] = value


def _wrap(recorder: Recorder, original: Callable) -> Callable:
    @functools.wraps(original)
    def init_function(*args: Any, **kwargs: Any) -> Tensor:
        return recorder.call_init(original, args, kwargs)
    return init_function


@contextlib.contextmanager
def _transformers_init(recorder: Recorder) -> Iterator[None]:
    """`PreTrainedModel.init_weights` runs `initialize_weights` on the meta device as eager init runs it off it
    (transformers skips it there: nothing to initialize); the recorder keeps its writes."""
    try:
        from transformers import PreTrainedModel
        from transformers.modeling_utils import get_torch_context_manager_or_global_device as device_now
    except ImportError:
        yield
        return
    original = PreTrainedModel.__dict__["init_weights"]

    @functools.wraps(original)
    def init_weights(self) -> None:
        if not recorder.paused and device_now() == torch.device("meta"):
            self.initialize_weights()
        original(self)  # (its own initialization is skipped on meta) and tie

    PreTrainedModel.init_weights = init_weights
    try:
        yield
    finally:
        PreTrainedModel.init_weights = original


@contextlib.contextmanager
def _models_built(found: Callable[[nn.Module], None]) -> Iterator[None]:
    """`found(model)` at the end for each module given tensors or children meanwhile that is no other's child, and
    for each copy of one made meanwhile (`copy.deepcopy` restores a module's state without registering anything: as
    ColossalAI's lazy tensors, a copy then materializes to the original's values, its clones being recorded)."""
    owners: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
    children: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()

    def owns(module: nn.Module, name: str, value: object) -> None:
        owners.add(module)
        if isinstance(value, nn.Module):
            children.add(value)

    original_setstate = nn.Module.__setstate__

    def setstate(module: nn.Module, state: dict) -> None:
        original_setstate(module, state)
        owners.add(module)
        children.update(module.children())

    handles = [nn_module.register_module_parameter_registration_hook(owns),
               nn_module.register_module_buffer_registration_hook(owns),
               nn_module.register_module_module_registration_hook(owns)]
    nn.Module.__setstate__ = setstate
    try:
        yield
    finally:
        nn.Module.__setstate__ = original_setstate
        for handle in handles:
            handle.remove()
    for module in list(owners):
        if module not in children:
            found(module)


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Record eager init meanwhile (under a meta device context); models built get their `InitSources` at the end."""
    recorder = Recorder()
    with _models_built(functools.partial(_bind, recorder)), contextlib.closing(recorder), recorder, \
            _DataOnCPU(recorder), _init_functions(recorder), _transformers_init(recorder):
        yield recorder


def _bind(recorder: Recorder, model: nn.Module) -> None:
    """Attach to `model` the records of its meta tensors, by name (a model loaded lazily keeps its checkpoint's)."""
    if sources_of(model) is not None:
        return
    entries, outside = {}, []
    for name, t in chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)):
        if t.is_meta:
            ref = recorder.recorded(t)
            if ref is None:
                outside.append(name)
            else:
                entries[name] = ref
    if entries:
        attach_sources(model, InitSources(entries))
    if outside and entries:
        warnings.warn(f"LazyInitContext has no record of how eager init fills {type(model).__name__}'s "
                      f"{sorted(outside)} (built on the meta device outside the context, from such tensors, or "
                      f"resized in place): boost initializes them with draws of each rank instead of eager init's")
