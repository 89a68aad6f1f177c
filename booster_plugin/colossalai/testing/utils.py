"""`colossalai.testing.utils`: spawning ranks, parameterizing inside them, rerunning on a taken port."""
from __future__ import annotations

import functools
import gc
import inspect
import random
import re
import socket
from typing import Any, Callable, Iterator, List, Optional, Type

import torch.multiprocessing as mp

from booster_plugin.compat.accelerator import get_accelerator

__all__ = ["parameterize", "rerun_on_exception", "rerun_if_address_is_in_use", "skip_if_not_enough_gpus", "free_port",
           "spawn", "clear_cache_before_run", "DummyDataloader"]


def _named(wrapper: Callable, func: Callable) -> Callable:
    """The wrapper under the function's name (so that spawn can pickle it) but without `__wrapped__`: pytest then
    sees the wrapper's own parameters, not the function's, which are not fixtures."""
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(wrapper, attr, getattr(func, attr, None))
    return wrapper


def parameterize(argument: str, values: List[Any]) -> Callable:
    """Run the decorated function once per value of `argument` (inside one set of spawned ranks, unlike
    pytest.mark.parametrize). Stacked decorators give every combination; other arguments must be keywords."""
    def decorator(func: Callable) -> Callable:
        def run_each(**kwargs: Any) -> None:
            for value in values:
                func(**{argument: value}, **kwargs)
        return _named(run_each, func)
    return decorator


def rerun_on_exception(exception_type: Type[BaseException] = Exception, pattern: Optional[str] = None,
                       max_try: Optional[int] = 5) -> Callable:
    """Rerun the decorated function when it raises `exception_type` whose message has a line matching `pattern`
    (any message when None), up to `max_try` tries in all (None: until it passes)."""
    if max_try is not None and not isinstance(max_try, int):
        raise TypeError(f"max_try must be None or an int, got {type(max_try).__name__}")

    def matches(error: BaseException) -> bool:
        return pattern is None or any(re.match(pattern, line) for line in str(error).split("\n"))

    def decorator(func: Callable) -> Callable:
        @functools.wraps(func)
        def run_until_success(*args: Any, **kwargs: Any) -> Any:
            tries = 0
            while True:
                tries += 1
                try:
                    return func(*args, **kwargs)
                except exception_type as error:
                    if (max_try is not None and tries >= max_try) or not matches(error):
                        raise
                    print(f"Exception is caught, retrying ({tries}): {error}")
        run_until_success.__signature__ = inspect.signature(func)  # pytest reads the parameters of the original
        return run_until_success
    return decorator


def rerun_if_address_is_in_use() -> Callable:
    """Rerun a test whose spawned ranks failed because the rendezvous port was taken meanwhile."""
    return rerun_on_exception(exception_type=mp.ProcessRaisedException, pattern=".*(A|a)ddress already in use.*")


def skip_if_not_enough_gpus(min_gpus: int) -> Callable:
    """Run the decorated function only when the machine has `min_gpus` devices (the CPU counts as one)."""
    def decorator(func: Callable) -> Callable:
        def run_if_enough(*args: Any, **kwargs: Any) -> None:
            if get_accelerator().device_count() >= min_gpus:
                func(*args, **kwargs)
        return _named(run_if_enough, func)
    return decorator


def free_port() -> int:
    """A port on localhost that nothing listens on now (random in 20000-65000, as ColossalAI's)."""
    while True:
        port = random.randint(20000, 65000)
        try:
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("localhost", port))
                return port
        except OSError:
            continue


def spawn(func: Callable, nprocs: int = 1, **kwargs: Any) -> None:
    """Run `func(rank, world_size=nprocs, port=<free port>, **kwargs)` on `nprocs` new processes and wait for them;
    an exception in any of them is raised here (torch.multiprocessing.ProcessRaisedException, with its traceback)."""
    mp.spawn(functools.partial(func, world_size=nprocs, port=free_port(), **kwargs), nprocs=nprocs)


def clear_cache_before_run() -> Callable:
    """Empty the accelerator's cache, reset its peak-memory counters and collect garbage before the function."""
    def decorator(func: Callable) -> Callable:
        def run_cleared(*args: Any, **kwargs: Any) -> Any:
            accelerator = get_accelerator()
            accelerator.empty_cache()
            accelerator.reset_peak_memory_stats()
            accelerator.reset_max_memory_allocated()
            accelerator.reset_max_memory_cached()
            accelerator.synchronize()
            gc.collect()
            return func(*args, **kwargs)
        return _named(run_cleared, func)
    return decorator


class DummyDataloader:
    """`length` batches, each a fresh `data_gen_fn()`."""

    def __init__(self, data_gen_fn: Callable[[], Any], length: int = 10) -> None:
        self.data_gen_fn, self.length, self.step = data_gen_fn, length, 0

    def __iter__(self) -> Iterator[Any]:
        self.step = 0
        return self

    def __next__(self) -> Any:
        if self.step >= self.length:
            raise StopIteration
        self.step += 1
        return self.data_gen_fn()

    def __len__(self) -> int:
        return self.length
