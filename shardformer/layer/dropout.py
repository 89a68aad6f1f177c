"""RNG bookkeeping for dropout under tensor parallelism, apart from the script's own global RNG.

Replicated activations need identical dropout masks on all TP ranks (a shared state), while sharded activations such
as a head shard of attention probabilities need a different mask per rank (a private state). Both are the tracker's:
the model's forward runs with the shared state swapped into torch's default generators (so that dropout inside the
model's own modules draws from it too), and the script's state is put back when the forward ends, untouched.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from .comm import get_tp_rank, get_tp_world_size

__all__ = ["TPRNGTracker", "has_dropout", "wrap_model_forward_in_tracker_rng", "wrap_module_forward_in_local_rng",
           "wrap_module_forward_in_shared_rng"]

_LOCAL_SEED_OFFSET = 2718


class TPRNGTracker:
    """Holds the shared RNG state (the same on every TP rank) the model's forward runs under, and one private state
    per TP rank that it swaps in around code that works on sharded activations.

    Tracks the CPU generator and, when `device` is an accelerator, that device's default generator.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device("cpu" if device is None else device)
        self.seed: int | None = None
        self._shared_states: list[Tensor] | None = None
        self._script_states: list[Tensor] | None = None  # the script's own state, while the model's forward runs
        self._model_depth = 0
        self._local_states: list[Tensor] | None = None
        self._saved: list[Tensor] | None = None
        self._depth = 0

    def _get_states(self) -> list[Tensor]:
        states = [torch.get_rng_state()]
        if self.device.type != "cpu":
            states.append(torch.get_device_module(self.device.type).get_rng_state(self.device))
        return states

    def _set_states(self, states: list[Tensor]) -> None:
        torch.set_rng_state(states[0])
        if self.device.type != "cpu":
            torch.get_device_module(self.device.type).set_rng_state(states[1], self.device)

    def _swap_in(self, states: list[Tensor]) -> list[Tensor]:
        """Put `states` into torch's default generators; returns the states they held (advanced since set)."""
        held = self._get_states()
        self._set_states(states)
        return held

    def _fresh_states(self, seed: int) -> list[Tensor]:
        states = [torch.Generator().manual_seed(seed).get_state()]
        if self.device.type != "cpu":
            states.append(torch.Generator(device=self.device).manual_seed(seed).get_state())
        return states

    def sync(self, group: ProcessGroup | None, base_seed: int) -> int:
        """(Re)create the shared state, seeded with the first rank of `group`'s `base_seed` on every rank of it, and
        this rank's private state, seeded `base_seed + 2718 + tp_rank`; returns the seed. Torch's default
        generators (the script's) are left as they are."""
        if get_tp_world_size(group) > 1:
            backend = str(dist.get_backend(group))
            seed = torch.tensor([base_seed], dtype=torch.int64,
                                device="cpu" if "gloo" in backend else self.device)
            dist.broadcast(seed, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
            base_seed = int(seed.item())
        self.seed = base_seed
        self._shared_states = self._fresh_states(base_seed)
        self._local_states = self._fresh_states(base_seed + _LOCAL_SEED_OFFSET + get_tp_rank(group))
        return base_seed

    def enter_model(self) -> None:
        """The model's forward starts: swap the shared state in, keeping the script's (re-entrant)."""
        if self._shared_states is None:
            raise RuntimeError("TPRNGTracker.sync() must be called before the model runs under the tracker's RNG")
        if self._model_depth == 0:
            self._script_states = self._swap_in(self._shared_states)
        self._model_depth += 1

    def exit_model(self) -> None:
        """The model's forward ends (also by an exception): keep the advanced shared state, put the script's back.
        Nothing to do when not entered (an earlier pre-hook of the model raised before `enter_model` ran)."""
        if self._model_depth == 0:
            return
        self._model_depth -= 1
        if self._model_depth == 0:
            self._shared_states = self._swap_in(self._script_states)
            self._script_states = None

    @contextmanager
    def model_rng(self) -> Iterator[None]:
        """Run the block as the model's forward runs: under the shared state; the script's is restored afterwards."""
        self.enter_model()
        try:
            yield
        finally:
            self.exit_model()

    @property
    def local_states(self) -> list[Tensor] | None:
        """The private state (replaced, never mutated, as it advances): activation checkpointing replays from it."""
        return self._local_states

    @local_states.setter
    def local_states(self, states: list[Tensor] | None) -> None:
        self._local_states = states

    def enter_local(self) -> None:
        """Swap the private per-rank state in (re-entrant)."""
        if self._local_states is None:
            raise RuntimeError("TPRNGTracker.sync() must be called before using the local RNG")
        if self._depth == 0:
            self._saved = self._swap_in(self._local_states)
        self._depth += 1

    def exit_local(self) -> None:
        """Keep the advanced private state and restore the default state."""
        if self._depth == 0:
            raise RuntimeError("exit_local() without a matching enter_local()")
        self._depth -= 1
        if self._depth == 0:
            self._local_states = self._swap_in(self._saved)
            self._saved = None

    def enter_shared(self) -> None:
        """Inside a local block, switch back to the shared default state (for dropout on replicated activations)."""
        if self._depth == 0:
            return
        self._local_states = self._swap_in(self._saved)

    def exit_shared(self) -> None:
        if self._depth == 0:
            return
        self._saved = self._swap_in(self._local_states)

    @contextmanager
    def local_rng(self) -> Iterator[None]:
        """Run the block with this rank's private RNG state; the default state is restored afterwards."""
        self.enter_local()
        try:
            yield
        finally:
            self.exit_local()


def wrap_model_forward_in_tracker_rng(model: nn.Module, tracker: TPRNGTracker) -> tuple[RemovableHandle, ...]:
    """Run `model`'s whole forward under the tracker's shared state, dropout of its own modules included; the exit
    hook runs even when the forward ends by an exception (a pipeline stage ends its forward by raising), so the
    script's RNG state is always put back."""

    def enter(mod: nn.Module, args: tuple) -> None:
        tracker.enter_model()

    def leave(mod: nn.Module, args: tuple, output: object) -> None:
        tracker.exit_model()

    return model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)


def has_dropout(module: nn.Module) -> bool:
    """Does `module` hold a dropout with a positive probability (an nn.Dropout, or a float `*dropout*` attribute
    as transformers' attentions keep `attention_dropout`)?"""
    return any(isinstance(value, float) and value > 0 and "dropout" in name
               for m in module.modules() for name, value in vars(m).items()) or \
        any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())


def _swaps(mod: nn.Module, dropping: bool) -> bool:
    """Must the RNG state be swapped around `mod`'s forward? Always in eager; inside a compiled region (where
    reading and setting torch's RNG state is a graph break) only when it draws random numbers: in training, with a
    dropout (as held when the hooks were installed)."""
    return not torch.compiler.is_compiling() or (mod.training and dropping)


def wrap_module_forward_in_local_rng(module: nn.Module, tracker: TPRNGTracker) -> tuple[RemovableHandle, ...]:
    """Run `module`'s forward under the tracker's per-rank RNG state (pre-hook enters, post-hook exits; the exit runs
    before the module's other forward hooks, one of which may end a pipeline stage's forward by raising)."""
    dropping = has_dropout(module)

    def enter(mod: nn.Module, args: tuple) -> None:
        if _swaps(mod, dropping):
            tracker.enter_local()

    def leave(mod: nn.Module, args: tuple, output: object) -> None:
        if _swaps(mod, dropping):
            tracker.exit_local()

    return module.register_forward_pre_hook(enter), module.register_forward_hook(leave, prepend=True)


def wrap_module_forward_in_shared_rng(module: nn.Module, tracker: TPRNGTracker) -> tuple[RemovableHandle, ...]:
    """Run `module`'s forward under the shared default state even inside a local-RNG module (e.g. GPT-2's
    `resid_dropout`, which acts on the replicated output of the attention block)."""
    dropping = has_dropout(module)

    def enter(mod: nn.Module, args: tuple) -> None:
        if _swaps(mod, dropping):
            tracker.enter_shared()

    def leave(mod: nn.Module, args: tuple, output: object) -> None:
        if _swaps(mod, dropping):
            tracker.exit_shared()

    return module.register_forward_pre_hook(enter), module.register_forward_hook(leave)
