"""What eager init wrote into each tensor of a model built under LazyInitContext, and its replay (record.py records).

Each meta storage built inside the context is a `Node`: the call that created it and the calls that wrote into it
since, in order (its tape). A call is an aten op as the dispatcher saw it on meta tensors, or one call of a torch
init function (`torch.nn.init.*`, opaque on meta). A meta tensor in a call's arguments is a `Ref`: its node, the
node's version then (how many writes it had had) and the view (dtype, size, stride, offset). A call that draws
random numbers keeps the generator states from just before eager init ran it.

`Replay` computes a node's contents at a version on the CPU: from the last call that overwrote the whole storage
(a restart) or the creation, each call run again as eager init ran it, the generators it drew from set to the
recorded states (on copies: the script's generators are left alone). Any tensor can thus be materialized alone, in
any order, on any rank, equal to eager init on the CPU.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["Ref", "Node", "Call", "Replay", "view_of"]

_CPU = torch.device("cpu")


class Call:
    """One recorded call: `func(*args, **kwargs)` with `Ref`s for meta tensors. `states`: (CPU default generator
    state, state of the generator passed to it or None) before eager init ran it, for calls that draw."""
    __slots__ = ("func", "args", "kwargs", "states", "writes")

    def __init__(self, func: Callable, args: tuple, kwargs: dict, states: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]],
                 writes: Tuple["Ref", ...]) -> None:
        self.func, self.args, self.kwargs, self.states, self.writes = func, args, kwargs, states, writes


class Node:
    """A meta storage: `nbytes`, the call that created it (and which of its flattened outputs), the calls that wrote
    into it (`tape`), the tape positions that overwrote all of it without reading it (`restarts`). `known` is False
    when its contents depend on a meta tensor built outside the recording (it cannot be replayed)."""
    __slots__ = ("nbytes", "creation", "tape", "restarts", "known", "anchor")

    def __init__(self, nbytes: int, creation: Optional[Tuple[Call, int]], known: bool, anchor: torch.Tensor) -> None:
        self.nbytes, self.creation, self.known = nbytes, creation, known
        self.tape: List[Call] = []
        self.restarts: List[int] = []
        self.anchor = anchor  # keeps the meta storage (and so its address, the recorder's key) alive


class Ref:
    """A meta tensor as a call saw it: `node` at `version`, viewed as dtype / size / stride / offset."""
    __slots__ = ("node", "version", "dtype", "size", "stride", "offset")

    def __init__(self, node: Node, version: int, t: torch.Tensor) -> None:
        self.node, self.version = node, version
        self.dtype, self.size, self.stride, self.offset = t.dtype, tuple(t.shape), t.stride(), t.storage_offset()

    def covers(self) -> bool:
        """Whether the view is all of its storage, contiguous."""
        numel, expected = 1, []
        for s in reversed(self.size):
            expected.append(numel)
            numel *= s
        contiguous = all(st == e for st, e, s in zip(self.stride, reversed(expected), self.size) if s > 1)
        return self.offset == 0 and contiguous and numel * self.dtype.itemsize == self.node.nbytes


def view_of(storage: torch.UntypedStorage, ref: Ref) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device=storage.device).set_(storage, ref.offset, ref.size, ref.stride)


class Replay:
    """Contents of recorded tensors, computed on the CPU; intermediate storages are kept until the object goes."""

    def __init__(self) -> None:
        self._done: Dict[Tuple[int, int], torch.UntypedStorage] = {}

    def tensor(self, ref: Ref) -> torch.Tensor:
        return view_of(self.storage(ref.node, ref.version), ref)

    @torch.no_grad()
    def storage(self, node: Node, version: int) -> torch.UntypedStorage:
        key = (id(node), version)
        if key in self._done:
            return self._done[key]
        if not node.known:
            raise RuntimeError("this tensor depends on a meta tensor built outside LazyInitContext: it has no record")
        start = max((i for i in node.restarts if i < version), default=None)
        if start is None:
            storage, start = self._create(node), 0
        else:
            storage = torch.empty(node.nbytes, dtype=torch.uint8, device=_CPU).untyped_storage()
        for i in range(start, version):
            self._done[(id(node), i)] = storage  # the call sees the storage as it is before it
            try:
                self.run(node.tape[i], node)
            finally:
                del self._done[(id(node), i)]
        self._done[key] = storage
        return storage

    def _create(self, node: Node) -> torch.UntypedStorage:
        call, index = node.creation
        out = tree_flatten(self.run(call, None))[0][index]
        storage = out.untyped_storage()
        if storage.nbytes() != node.nbytes:
            raise RuntimeError(f"replaying {call.func} gave a storage of {storage.nbytes()} bytes, the meta tensor's "
                               f"had {node.nbytes}")
        return storage

    def run(self, call: Call, writing: Optional[Node]) -> object:
        """Run `call` again on real tensors. Other nodes it writes into get copies (their own tapes have the call)."""
        def real(x: object) -> object:
            if isinstance(x, Ref):
                storage = self.storage(x.node, x.version)
                if x.node is not writing and any(w is x for w in call.writes):
                    storage = storage.clone()
                return view_of(storage, x)
            if isinstance(x, torch.device) and x.type == "meta":
                return _CPU
            if isinstance(x, torch.Generator) and call.states is not None:
                return torch.Generator().set_state(call.states[1])
            return x

        args, kwargs = tree_map(real, (call.args, call.kwargs))
        with _generator_at(call.states), torch.device(_CPU):
            return call.func(*args, **kwargs)


@contextlib.contextmanager
def _generator_at(states: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]):
    """The CPU default generator at the recorded state meanwhile, and back where it was after."""
    if states is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(states[0])
        yield
