"""HybridParallelCheckpointIO: the collective checkpoint calls (ColossalAI 0.5's signatures) of a plugin.

Every method is collective: call it on every rank. Errors on any rank are agreed on by an all-reduce before
anything changes, so every rank raises the same CheckpointError and nothing hangs. Saves with `use_async=True`
return once the tensors are gathered and copied; files are written in a background thread, and the next checkpoint
call or `synchronize()` waits for them (a failed or interrupted background save leaves the previous checkpoint).
"""
from __future__ import annotations

import os
import weakref
from typing import Optional

import torch
from torch import nn

from ..core.optimizer import HybridParallelOptimizer
from ..core.parallel_module import HybridParallelModule
from .context import CheckpointContext
from .jobs import agree, describe, synchronize
from .lora import save_lora_as_pretrained
from .model import module_of
from .model_load import read_model
from .model_save import save_model
from .optimizer import optimizer_parts
from .optimizer_groups import agree_on_groups
from .optimizer_load import apply_optimizer, read_optimizer
from .optimizer_save import save_optimizer
from .reads import guarded_read
from .scheduler import Scheduler, read_lr_scheduler, save_lr_scheduler

# boosted module -> the optimizers boosted with it (bf16 training keeps fp32 master weights there). Process-wide:
# the link is a fact about the two objects, so a load through any Booster / CheckpointIO refreshes the master
# weights; weak on both sides, so it keeps neither alive.
_OPTIMIZERS: "weakref.WeakKeyDictionary[HybridParallelModule, weakref.WeakSet[HybridParallelOptimizer]]" = \
    weakref.WeakKeyDictionary()


class HybridParallelCheckpointIO:
    """Collective checkpoint operations for a HybridParallelPlugin (`CheckpointContext.from_plugin(plugin)`): every
    rank calls each method."""

    def __init__(self, context: CheckpointContext) -> None:
        self.context = context

    @staticmethod
    def register_optimizer(model: nn.Module, optimizer: Optional[HybridParallelOptimizer]) -> None:
        """Remember the optimizer boosted with `model`, so load_model also refreshes its fp32 master weights."""
        if isinstance(optimizer, HybridParallelOptimizer):
            _OPTIMIZERS.setdefault(model, weakref.WeakSet()).add(optimizer)

    def synchronize(self) -> None:
        """Wait for the process's background saves (use_async=True); collective. Raises CheckpointError on every
        rank if one failed (its checkpoint was not swapped in; the previous one is intact)."""
        synchronize(self.context.device)

    def _sync_d2h(self) -> None:
        """ColossalAI's name for "device-to-host copies done": ours are done before an async save returns."""

    def _sync_io(self) -> None:
        """ColossalAI's name for waiting on background writes: `synchronize`."""
        self.synchronize()

    # -- model ---------------------------------------------------------------------------------------------------
    def save_model(self, model: nn.Module, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                   prefix: Optional[str] = None, size_per_shard: float = 1024, use_safetensors: bool = False,
                   use_async: bool = False) -> None:
        """See model_save.py for where it writes. `use_safetensors` is accepted for ColossalAI compatibility: a
        directory or `.safetensors` path is always safetensors, a `.pt`/`.bin` path a torch.save of plain tensors."""
        self.synchronize()
        save_model(self.context, module_of(model), os.fspath(checkpoint), shard, gather_dtensor, prefix,
                   size_per_shard, use_async)

    def load_model(self, model: nn.Module, checkpoint: str, strict: bool = True, low_cpu_mem_mode: bool = True,
                   num_threads: int = 1, *, verify_checksums: bool = True) -> None:
        """Into any layout; each rank reads only its slices and checks their files' CRC32s (`num_threads` threads;
        `verify_checksums=False` skips that). `low_cpu_mem_mode` has no effect: tensors are always read slice by
        slice. Nothing changes on any rank unless every rank read everything."""
        self.synchronize()
        module = module_of(model)
        path = os.fspath(checkpoint)
        pending, error = guarded_read(lambda reads: read_model(self.context, module, path, strict, reads),
                                      verify_checksums, num_threads)
        agree(error, f"load_model({checkpoint!r})", self.context.device)
        optimizers = list(_OPTIMIZERS.get(module, ()))
        with torch.no_grad():
            for p, t in pending:
                p.copy_(t)
                for opt in optimizers:  # mixed precision: the fp32 master weights (ZeRO: this rank's slice) too
                    opt.load_master_weight(p, t)

    def save_lora_as_pretrained(self, model: nn.Module, checkpoint: str, use_safetensors: bool = False) -> None:
        """The LoRA adapters as a peft adapter directory (see lora.py); always safetensors, `use_safetensors` is
        accepted for ColossalAI compatibility."""
        self.synchronize()
        save_lora_as_pretrained(self.context, module_of(model), os.fspath(checkpoint))

    # -- optimizer -----------------------------------------------------------------------------------------------
    def save_optimizer(self, optimizer: HybridParallelOptimizer, checkpoint: str, shard: bool = False,
                       gather_dtensor: bool = True, prefix: Optional[str] = None, size_per_shard: float = 1024,
                       use_async: bool = False) -> None:
        """Always sharded by (stage, tp rank) into directory `checkpoint`; `shard`, `gather_dtensor` and
        `size_per_shard` are accepted for ColossalAI compatibility and do not change that."""
        self.synchronize()
        optimizer_parts(optimizer)  # type check before any collective
        with optimizer.unpartitioned():  # ZeRO: saved as if unpartitioned (the files are the same for any zero_stage)
            save_optimizer(self.context, optimizer, os.fspath(checkpoint), prefix, use_async)

    def load_optimizer(self, optimizer: HybridParallelOptimizer, checkpoint: str, prefix: Optional[str] = None,
                       low_cpu_mem_mode: bool = True, num_threads: int = 1, *, strict: bool = True,
                       verify_checksums: bool = True) -> None:
        """From any layout, matching param groups and state by parameter name. `strict=False`: state for parameters
        the model does not have (or missing state) is skipped with a warning naming them."""
        self.synchronize()
        optimizer_parts(optimizer)  # type check before any collective
        ctx, path, action = self.context, os.fspath(checkpoint), f"load_optimizer({checkpoint!r})"
        with optimizer.unpartitioned(load=True):  # ZeRO: loaded unpartitioned, then sliced back
            parts = optimizer_parts(optimizer)
            loaded, error = guarded_read(lambda reads: read_optimizer(ctx, parts, path, prefix, strict, reads),
                                         verify_checksums, num_threads)
            agree(error, action, ctx.device)
            # each stage matched its own parameters' groups: the stages must match the same way
            agree(agree_on_groups(parts, loaded.members, ctx.stage, ctx.device), action, ctx.device)
            apply_optimizer(parts.optim, loaded)
            if optimizer.scaler is not None and loaded.loss_scaler is not None:  # fp16: the loss scale comes back
                optimizer.scaler.load_state_dict(loaded.loss_scaler)

    # -- lr scheduler ----------------------------------------------------------------------------------------------
    def save_lr_scheduler(self, lr_scheduler: Scheduler, checkpoint: str) -> None:
        """Rank 0 writes the scheduler's state_dict as JSON (atomically: temporary file, fsync, rename)."""
        self.synchronize()
        save_lr_scheduler(self.context, lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: Scheduler, checkpoint: str) -> None:
        self.synchronize()
        error, state = None, None
        try:
            state = read_lr_scheduler(lr_scheduler, checkpoint)
        except Exception as exc:
            error = f"{checkpoint}: {describe(exc)}"
        agree(error, f"load_lr_scheduler({checkpoint!r})", self.context.device)
        lr_scheduler.load_state_dict(state)
