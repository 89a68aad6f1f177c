"""HybridParallelCheckpointIO: the collective checkpoint calls (ColossalAI 0.5's signatures) of a plugin.

Every method is collective: call it on every rank. Errors on any rank are agreed on by an all-reduce before
anything changes, so every rank raises the same CheckpointError and nothing hangs. Saves with `use_async=True`
return once the tensors are gathered and copied; files are written in a background thread, and the next checkpoint
call or `synchronize()` waits for them (a failed or interrupted background save leaves the previous checkpoint).
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..optimizer import HybridParallelOptimizer
from . import atomic
from . import format as fmt
from . import lora as lora_ckpt
from . import model as model_ckpt
from . import optimizer as optim_ckpt
from . import jobs
from .jobs import agree, describe

# boosted module -> the optimizers boosted with it (bf16 training keeps fp32 master weights there)
_OPTIMIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class HybridParallelCheckpointIO:
    """Collective checkpoint operations for a HybridParallelPlugin: every rank calls each method."""

    def __init__(self, plugin) -> None:
        self.plugin = plugin

    @staticmethod
    def register_optimizer(model, optimizer) -> None:
        """Remember the optimizer boosted with `model`, so load_model also refreshes its fp32 master weights."""
        if isinstance(optimizer, HybridParallelOptimizer):
            _OPTIMIZERS.setdefault(model, weakref.WeakSet()).add(optimizer)

    # -- helpers used by the model / optimizer modules -----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return getattr(self.plugin, "device", torch.device("cpu"))

    def agree(self, error: Optional[str], action: str) -> None:
        agree(error, action, self.device)

    describe = staticmethod(describe)

    def writer_rank(self, stage: int) -> int:
        """The global rank that writes a stage's tensors: dp rank 0, tp rank 0 of that stage."""
        return self.plugin.pg_mesh.ravel((0, stage, 0))

    def synchronize(self) -> None:
        """Wait for the process's background saves (use_async=True); collective. Raises CheckpointError on every
        rank if one failed (its checkpoint was not swapped in; the previous one is intact)."""
        jobs.synchronize(self.device)

    def _sync_d2h(self) -> None:
        """ColossalAI's name for "device-to-host copies done": ours are done before an async save returns."""

    def _sync_io(self) -> None:
        """ColossalAI's name for waiting on background writes: `synchronize`."""
        self.synchronize()

    def finish(self, job: jobs.SaveJob, use_async: bool) -> None:
        job.timeout_s = self.plugin.timeout  # rank 0 waits that long for the other writers
        jobs.finish(job, use_async, self.device)

    def _guarded_read(self, read: Callable, *args) -> Tuple[Any, Optional[str]]:
        """Run a reader (its last argument: a dict it fills with open files); always close the files; return
        (its result, None) or (None, the error message) for `agree`."""
        handles: Dict[str, fmt.TensorFile] = {}
        try:
            return read(self, *args, handles), None
        except Exception as exc:
            return None, describe(exc)
        finally:
            for h in handles.values():
                h.close()

    # -- model ---------------------------------------------------------------------------------------------------
    def save_model(self, model, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                   prefix: Optional[str] = None, size_per_shard: float = 1024, use_safetensors: bool = False,
                   use_async: bool = False) -> None:
        """See model.py for where it writes. `use_safetensors` is accepted for ColossalAI compatibility: a directory
        or `.safetensors` path is always safetensors, a `.pt`/`.bin` path a torch.save of plain tensors."""
        self.synchronize()
        model_ckpt.save_model(self, model, os.fspath(checkpoint), shard, gather_dtensor, prefix, size_per_shard,
                              use_async)

    def load_model(self, model, checkpoint: str, strict: bool = True, low_cpu_mem_mode: bool = True,
                   num_threads: int = 1, *, verify_checksums: bool = True) -> None:
        """Into any layout; each rank reads only its slices and checks their files' CRC32s (`num_threads` threads;
        `verify_checksums=False` skips that). `low_cpu_mem_mode` has no effect: tensors are always read slice by
        slice. Nothing changes on any rank unless every rank read everything."""
        self.synchronize()
        module = model_ckpt.module_of(model)
        pending, error = self._guarded_read(model_ckpt.read_model, module, os.fspath(checkpoint), strict,
                                            verify_checksums, num_threads)
        self.agree(error, f"load_model({checkpoint!r})")
        optimizers = list(_OPTIMIZERS.get(module, ()))
        with torch.no_grad():
            for p, t in pending:
                p.copy_(t)
                for opt in optimizers:  # mixed precision: the fp32 master weights (ZeRO: this rank's slice) too
                    opt.load_master_weight(p, t)

    def save_lora_as_pretrained(self, model, checkpoint: str, use_safetensors: bool = False) -> None:
        """The LoRA adapters as a peft adapter directory (see lora.py); always safetensors, `use_safetensors` is
        accepted for ColossalAI compatibility."""
        self.synchronize()
        lora_ckpt.save_lora_as_pretrained(self, model, os.fspath(checkpoint))

    # -- optimizer -----------------------------------------------------------------------------------------------
    def save_optimizer(self, optimizer, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                       prefix: Optional[str] = None, size_per_shard: float = 1024, use_async: bool = False) -> None:
        """Always sharded by (stage, tp rank) into directory `checkpoint`; `shard`, `gather_dtensor` and
        `size_per_shard` are accepted for ColossalAI compatibility and do not change that."""
        self.synchronize()
        optim_ckpt.optimizer_parts(optimizer)  # type check before any collective
        with optimizer.unpartitioned():  # ZeRO: saved as if unpartitioned (the files are the same for any zero_stage)
            optim_ckpt.save_optimizer(self, optimizer, os.fspath(checkpoint), prefix, use_async)

    def load_optimizer(self, optimizer, checkpoint: str, prefix: Optional[str] = None, low_cpu_mem_mode: bool = True,
                       num_threads: int = 1, *, strict: bool = True, verify_checksums: bool = True) -> None:
        """From any layout, matching param groups and state by parameter name. `strict=False`: state for parameters
        the model does not have (or missing state) is skipped with a warning naming them."""
        self.synchronize()
        optim_ckpt.optimizer_parts(optimizer)  # type check before any collective
        with optimizer.unpartitioned(load=True):  # ZeRO: loaded unpartitioned, then sliced back
            parts = optim_ckpt.optimizer_parts(optimizer)
            loaded, error = self._guarded_read(optim_ckpt.read_optimizer, parts, os.fspath(checkpoint), prefix,
                                               strict, verify_checksums, num_threads)
            self.agree(error, f"load_optimizer({checkpoint!r})")
            # each stage matched its own parameters' groups: the stages must match the same way
            self.agree(optim_ckpt.agree_on_groups(parts, loaded, self.plugin.stage, self.device),
                       f"load_optimizer({checkpoint!r})")
            optim_ckpt.apply_optimizer(parts.optim, loaded)
            if optimizer.scaler is not None and loaded.loss_scaler is not None:  # fp16: the loss scale comes back
                optimizer.scaler.load_state_dict(loaded.loss_scaler)

    # -- lr scheduler ----------------------------------------------------------------------------------------------
    def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        """Rank 0 writes the scheduler's state_dict as JSON (atomically: temporary file, fsync, rename)."""
        self.synchronize()
        error = None
        if dist.get_rank() == 0:
            try:
                state = fmt.to_json(lr_scheduler.state_dict(), f"{type(lr_scheduler).__name__}.state_dict()")
                tmp = atomic.prepare_file(checkpoint)
                fmt.write_json(tmp, {"scheduler": type(lr_scheduler).__name__, "state_dict": state})
                atomic.replace_file(tmp, checkpoint)
            except Exception as exc:
                error = describe(exc)
        self.agree(error, f"save_lr_scheduler({checkpoint!r})")

    def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        self.synchronize()
        error, state = None, None
        try:
            saved = fmt.read_json(checkpoint, "lr scheduler checkpoint")
            if saved.get("scheduler") != type(lr_scheduler).__name__:
                raise ValueError(f"{checkpoint} holds a {saved.get('scheduler')} state, the scheduler is a "
                                 f"{type(lr_scheduler).__name__}")
            state = fmt.from_json(saved["state_dict"])
        except Exception as exc:
            error = f"{checkpoint}: {describe(exc)}"
        self.agree(error, f"load_lr_scheduler({checkpoint!r})")
        lr_scheduler.load_state_dict(state)
