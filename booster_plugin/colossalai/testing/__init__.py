"""`colossalai.testing`: the harness ColossalAI's own tests are written with (and a user's tests written like them).

`spawn(func, nprocs, **kwargs)` runs `func(rank, world_size=nprocs, port=<free port>, **kwargs)` on `nprocs` processes
(torch.multiprocessing.spawn; `booster_plugin.colossalai.launch(rank=..., world_size=..., host=..., port=...)` then
joins them with the device's backend: gloo on the CPU, NCCL on GPUs) and raises in the caller when any of them fails.
`parameterize` runs the decorated function once per value (nested: every combination), `rerun_if_address_is_in_use`
reruns a test whose rendezvous port was taken, `clear_cache_before_run` empties the accelerator's cache first; the
assertions compare as ColossalAI's (`check_state_dict_equal`: same keys, tensors within 1e-3, lists as lists).
"""
from .comparison import (assert_close, assert_close_loose, assert_equal, assert_equal_in_group, assert_hf_output_close,
                         assert_not_equal, check_state_dict_equal, check_state_dict_equal_pytree)
from .pytest_wrapper import run_on_environment_flag
from .utils import (DummyDataloader, clear_cache_before_run, free_port, parameterize, rerun_if_address_is_in_use,
                    rerun_on_exception, skip_if_not_enough_gpus, spawn)

__all__ = ["assert_equal", "assert_not_equal", "assert_close", "assert_close_loose", "assert_equal_in_group",
           "parameterize", "rerun_on_exception", "rerun_if_address_is_in_use", "skip_if_not_enough_gpus", "free_port",
           "spawn", "clear_cache_before_run", "run_on_environment_flag", "check_state_dict_equal",
           "check_state_dict_equal_pytree", "assert_hf_output_close", "DummyDataloader"]
