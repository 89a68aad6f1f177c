"""ColossalAI's accelerator API (`colossalai.accelerator`: BaseAccelerator, CudaAccelerator, CpuAccelerator) over torch.

One class serves every device: the device's own torch module (`torch.cuda`, `torch.xpu`, ... via
`torch.get_device_module`) where torch has an accelerator, the CPU otherwise. On the CPU, where ColossalAI's
CpuAccelerator raises for most calls, this one answers as torch's CPU does: streams and events are torch.cpu's,
synchronization and cache clearing do nothing, the random generator is torch's default one, and memory figures are
the process's resident set (current: `memory_allocated`/`memory_reserved`; peak: `max_memory_*`, which the operating
system cannot reset, so the `reset_*` calls leave it).
"""
from __future__ import annotations

import contextlib
import functools
import resource
from typing import Any, ContextManager, Dict, List, Optional, Tuple, Union

import psutil
import torch
import torch.distributed as dist
from torch import nn

from ..guards.launch import default_device

__all__ = ["Accelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator", "set_accelerator",
           "auto_set_accelerator"]

Device = Optional[Union[torch.device, int, str]]


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class Accelerator:
    """The device this rank computes on, with ColossalAI's method names. `name` is the device type ("cuda", "cpu",
    ...), `communication_backend` torch's default backend for it (NCCL for CUDA, gloo for the CPU)."""

    def __init__(self, name: Optional[str] = None) -> None:
        if name is None:
            acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            name = acc.type if acc is not None else "cpu"
        self._name = name
        self._mod = torch.get_device_module(name)
        self._communication_backend = dist.Backend.default_device_backend_map.get(name, "gloo")

    @property
    def name(self) -> str:
        return self._name

    @property
    def communication_backend(self) -> str:
        return self._communication_backend

    @property
    def is_synchronous(self) -> bool:
        return self._name == "cpu"

    @property
    def support_set_device(self) -> bool:
        return self._name != "cpu"

    def __repr__(self) -> str:
        return f"Accelerator(name={self._name}, communication_backend={self._communication_backend})"

    def _cpu(self) -> bool:
        return self._name == "cpu"

    # device
    def get_version(self) -> str:
        return "" if self._cpu() else str(getattr(torch.version, self._name, "") or "")

    def get_current_device(self) -> torch.device:
        """This rank's device: the accelerator picked by LOCAL_RANK (bound here), or the CPU."""
        return torch.device("cpu") if self._cpu() else default_device()

    def current_device(self) -> int:
        return 0 if self._cpu() else self._mod.current_device()

    def set_device(self, device: Device = None) -> None:
        """Bind the process to `device`; None: rank % device_count, as ColossalAI (nothing to bind on the CPU)."""
        if self._cpu():
            return
        if device is None:
            if not dist.is_initialized():
                raise RuntimeError("set_device() without a device needs torch.distributed initialized (it picks "
                                   "rank % device_count): pass the device or launch first.")
            device = dist.get_rank() % self.device_count()
        self._mod.set_device(device)

    def get_device_name(self, device: Device = None) -> str:
        return "cpu" if self._cpu() else self._mod.get_device_name(device)

    def get_device_capability(self, device: Device = None) -> Tuple[int, int]:
        if self._cpu():
            raise RuntimeError("get_device_capability() is a GPU compute capability; the CPU has none.")
        return self._mod.get_device_capability(device)

    def get_device_properties(self, device: Device = None) -> Any:
        if self._cpu():
            raise RuntimeError("get_device_properties() describes a GPU; the CPU has none (use psutil).")
        return self._mod.get_device_properties(device)

    def utilization(self, device: Device = None) -> int:
        return int(psutil.cpu_percent()) if self._cpu() else self._mod.utilization(device)

    def synchronize(self, device: Device = None) -> None:
        if not self._cpu():
            self._mod.synchronize(device)

    def is_available(self) -> bool:
        return True if self._cpu() else self._mod.is_available()

    def device_count(self) -> int:
        return 1 if self._cpu() else self._mod.device_count()

    def set_to_device(self, models: Union[nn.Module, List[nn.Module]]) -> Union[nn.Module, List[nn.Module]]:
        """Move a module (or a list of modules) to this rank's device."""
        device = self.get_current_device()
        if isinstance(models, list):
            return [model.to(device) for model in models]
        return models.to(device)

    # random number generators
    def get_rng_state(self, device: Device = None) -> torch.Tensor:
        return torch.get_rng_state() if self._cpu() else self._mod.get_rng_state(device or self._name)

    def get_rng_state_all(self) -> List[torch.Tensor]:
        return [torch.get_rng_state()] if self._cpu() else self._mod.get_rng_state_all()

    def set_rng_state(self, new_state: torch.Tensor, device: Device = None) -> None:
        if self._cpu():
            torch.set_rng_state(new_state)
        else:
            self._mod.set_rng_state(new_state, device or self._name)

    def set_rng_state_all(self, new_states: List[torch.Tensor]) -> None:
        if self._cpu():
            torch.set_rng_state(new_states[0])
        else:
            self._mod.set_rng_state_all(new_states)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed) if self._cpu() else self._mod.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed) if self._cpu() else self._mod.manual_seed_all(seed)

    def seed(self) -> None:
        torch.seed() if self._cpu() else self._mod.seed()

    def seed_all(self) -> None:
        torch.seed() if self._cpu() else self._mod.seed_all()

    def initial_seed(self) -> int:
        return torch.initial_seed() if self._cpu() else self._mod.initial_seed()

    # memory
    def empty_cache(self) -> None:
        if not self._cpu():
            self._mod.empty_cache()

    def memory_stats(self, device: Device = None) -> Dict[str, Any]:
        if self._cpu():
            return {"allocated_bytes.all.current": _rss(), "allocated_bytes.all.peak": _peak_rss()}
        return self._mod.memory_stats(device)

    def memory_summary(self, device: Device = None, abbreviated: bool = False) -> str:
        if self._cpu():
            return f"resident set: {_rss()} bytes, peak {_peak_rss()} bytes"
        return self._mod.memory_summary(device, abbreviated=abbreviated)

    def memory_snapshot(self) -> Any:
        return [] if self._cpu() else self._mod.memory_snapshot()

    def memory_allocated(self, device: Device = None) -> int:
        return _rss() if self._cpu() else self._mod.memory_allocated(device)

    def max_memory_allocated(self, device: Device = None) -> int:
        return _peak_rss() if self._cpu() else self._mod.max_memory_allocated(device)

    def memory_reserved(self, device: Device = None) -> int:
        return _rss() if self._cpu() else self._mod.memory_reserved(device)

    def max_memory_reserved(self, device: Device = None) -> int:
        return _peak_rss() if self._cpu() else self._mod.max_memory_reserved(device)

    def reset_max_memory_allocated(self, device: Device = None) -> None:
        self.reset_peak_memory_stats(device)

    def reset_max_memory_cached(self, device: Device = None) -> None:
        self.reset_peak_memory_stats(device)

    def reset_peak_memory_stats(self, device: Device = None) -> None:
        if not self._cpu():
            self._mod.reset_peak_memory_stats(device)

    def set_per_process_memory_fraction(self, fraction: float, device: Device = None) -> None:
        """Cap this process's memory: the device's allocator, or on the CPU the address space (as ColossalAI)."""
        if self._cpu():
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (int(psutil.virtual_memory().total * fraction), hard))
        else:
            self._mod.set_per_process_memory_fraction(fraction, device)

    # streams and events
    def Stream(self, device: Device = None, priority: int = 0, **kwargs: Any) -> Any:  # noqa: N802 (ColossalAI's)
        return torch.cpu.Stream(priority=priority) if self._cpu() else self._mod.Stream(device, priority, **kwargs)

    def Event(self, enable_timing: bool = False, blocking: bool = False,  # noqa: N802 (ColossalAI's name)
              interprocess: bool = False) -> Any:
        if self._cpu():  # CPU work is synchronous: torch.cpu's event is complete when recorded (no timing)
            return torch.cpu.Event()
        return self._mod.Event(enable_timing, blocking, interprocess)

    def current_stream(self, device: Device = None) -> Any:
        return torch.cpu.current_stream() if self._cpu() else self._mod.current_stream(device)

    def default_stream(self, device: Device = None) -> Any:
        return torch.cpu.current_stream() if self._cpu() else self._mod.default_stream(device)

    def set_stream(self, stream_: Any) -> None:
        if not self._cpu():
            self._mod.set_stream(stream_)

    def stream(self, stream_: Any) -> ContextManager:
        return torch.cpu.stream(stream_) if self._cpu() else self._mod.stream(stream_)

    # mixed precision
    def autocast(self, enabled: bool = True, dtype: torch.dtype = torch.float16,
                 cache_enabled: bool = True) -> ContextManager:
        """torch's autocast for this device (`with get_accelerator().autocast():`, as ColossalAI's CUDA one). On the
        CPU, as ColossalAI's, it does nothing (torch's CPU autocast runs bf16 only)."""
        if self._cpu():
            return contextlib.nullcontext()
        return torch.amp.autocast(device_type=self._name, enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class CudaAccelerator(Accelerator):
    def __init__(self) -> None:
        super().__init__("cuda")


class CpuAccelerator(Accelerator):
    def __init__(self) -> None:
        super().__init__("cpu")


def _make(name: str) -> Accelerator:
    return {"cuda": CudaAccelerator, "cpu": CpuAccelerator}.get(name, functools.partial(Accelerator, name))()


_current: List[Accelerator] = []


def set_accelerator(accelerator: Union[str, Accelerator]) -> None:
    """Make `accelerator` (a device type or an Accelerator) the process's accelerator."""
    if not isinstance(accelerator, (str, Accelerator)):
        raise TypeError(f"set_accelerator takes a device type ('cuda', 'cpu') or an Accelerator, got "
                        f"{type(accelerator).__name__}.")
    _current[:] = [_make(accelerator) if isinstance(accelerator, str) else accelerator]


def auto_set_accelerator() -> None:
    """The process's accelerator: torch's current accelerator where there is one, else the CPU."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    _current[:] = [_make(acc.type if acc is not None else "cpu")]


def get_accelerator() -> Accelerator:
    if not _current:
        auto_set_accelerator()
    return _current[0]
