"""Booster: the user-facing entry point (ColossalAI's names and signatures)."""
from __future__ import annotations

import warnings
from typing import Callable, ContextManager, Iterator, Optional

import torch
from torch import nn

from .core.lora import enable_lora
from .core.parallel_module import HybridParallelModule
from .plugins.hybrid import HybridParallelPlugin
from .plugins.base import BoosterCheckpointIO, PipelineResult, Plugin
from .core.torch_amp import apply_torch_amp, torch_amp


class Booster:
    """ColossalAI's Booster. Args:
        device: accepted for compatibility (the plugin places each rank on its accelerator, else the CPU).
        mixed_precision: as in ColossalAI, "fp16" or "bf16" runs torch AMP (autocast; fp16 with torch's GradScaler)
            around a plugin that does not control precision (TorchDDPPlugin; see core/torch_amp.py); the other plugins
            control it (`precision=`), and a value here is ignored with a warning.
        plugin: HybridParallelPlugin, LowLevelZeroPlugin or TorchDDPPlugin (any `Plugin`); may also be given to
            `boost(..., plugin=...)`. Without either, `boost` uses HybridParallelPlugin() (data parallel over the
            whole world).
    """

    def __init__(self, device: Optional[str] = None, mixed_precision: Optional[str] = None,
                 plugin: Optional[Plugin] = None) -> None:
        self._amp = torch_amp(mixed_precision)
        if plugin is not None:
            _check_plugin(plugin)
        self._plugin = plugin
        if plugin is not None:
            self._warn_ignored_precision(stacklevel=3)
        self.device = device

    @property
    def plugin(self) -> Plugin:
        if self._plugin is None:  # made on first use, so that Booster() may be created before the plugin is known
            self._plugin = HybridParallelPlugin()
        return self._plugin

    def boost(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
              criterion: Optional[Callable] = None, dataloader=None, lr_scheduler=None,
              plugin: Optional[Plugin] = None):
        """Shard `model` for this rank and wrap the optimizer; returns (model, optimizer, criterion, dataloader,
        lr_scheduler).

        Args:
            plugin: configures a Booster made without one (`booster.boost(model, optimizer, plugin=...)`); an error
                if the Booster already has a different plugin.
        """
        if plugin is not None:
            if self._plugin is not None and self._plugin is not plugin:
                raise ValueError("This Booster already has a plugin; pass the plugin either to Booster(plugin=...) or "
                                 "to boost(..., plugin=...), not a different one to each.")
            _check_plugin(plugin)
            self._plugin = plugin
        self._warn_ignored_precision(stacklevel=3)
        boosted = self.plugin.configure(model, optimizer, criterion, dataloader, lr_scheduler)
        if self._amp is not None and not self.plugin.control_precision():
            boosted = (*apply_torch_amp(self._amp, self.plugin.device, *boosted[:3]), *boosted[3:])
        self.checkpoint_io.register_optimizer(boosted[0], boosted[1])  # load_model refreshes its master weights
        return boosted

    def _warn_ignored_precision(self, stacklevel: int) -> None:
        if self._amp is not None and self.plugin.control_precision():
            warnings.warn(f"Booster(mixed_precision={self._amp.name!r}) is ignored: {type(self.plugin).__name__} "
                          f"controls precision (as in ColossalAI); use its precision= argument.", stacklevel=stacklevel)
            self._amp = None

    def enable_lora(self, model: nn.Module, pretrained_dir: Optional[str] = None, lora_config=None,
                    bnb_quantization_config=None, quantize: bool = False) -> nn.Module:
        """Add LoRA adapters (Hugging Face peft) to `model` before `boost`; returns the peft model to boost. Adapters
        on tensor-parallel layers are sharded with their base layer; pipeline and data parallel apply as usual.

        Args:
            model: the transformers model, not yet boosted (built under LazyInitContext too: the adapters are
                initialized at boost, the base weights come from `load_model`).
            pretrained_dir: a directory saved by `save_lora_as_pretrained` (or peft's `save_pretrained`): its adapter
                is loaded, trainable (`PeftModel.from_pretrained(model, pretrained_dir, is_trainable=True)`).
            lora_config: a `peft.LoraConfig` for new adapters (`peft.get_peft_model(model, lora_config)`).
            bnb_quantization_config, quantize: quantized LoRA (bitsandbytes) is not supported: refused.
        """
        if isinstance(model, HybridParallelModule):
            raise ValueError("enable_lora must be called before booster.boost: the model is already boosted (sharded). "
                             "Call model = booster.enable_lora(model, lora_config=...) first, then boost the result.")
        return enable_lora(model, pretrained_dir, lora_config, bnb_quantization_config, quantize)

    def save_lora_as_pretrained(self, model: nn.Module, checkpoint: str, use_safetensors: bool = False) -> None:
        """Collective: write the boosted model's LoRA adapters, gathered from every tp rank and pipeline stage, as a
        standard peft adapter directory (`adapter_config.json`, `adapter_model.safetensors`), atomically;
        `PeftModel.from_pretrained(unsharded_model, checkpoint)` loads it. Always safetensors (`use_safetensors` is
        accepted for compatibility)."""
        self.plugin.arrive("save_lora_as_pretrained")
        self.checkpoint_io.save_lora_as_pretrained(model, checkpoint, use_safetensors)

    def backward(self, loss: torch.Tensor, optimizer) -> None:
        """Backward of `loss` through the boosted optimizer (with a pipeline, execute_pipeline runs the backward
        passes)."""
        if not callable(getattr(optimizer, "backward", None)):  # e.g. a torch optimizer that skipped boost
            raise TypeError(f"booster.backward needs the optimizer booster.boost returned, got a "
                            f"{type(optimizer).__module__}.{type(optimizer).__name__} that did not go through boost: "
                            f"build it from the model's parameters before boosting and pass it to boost: `model, "
                            f"optimizer, *_ = booster.boost(model, optimizer)`, then use the optimizer boost returned.")
        self.plugin.backward(loss, optimizer)

    def execute_pipeline(self, data_iter: Iterator, model: nn.Module, criterion: Optional[Callable], optimizer=None,
                         return_loss: bool = True, return_outputs: bool = False) -> PipelineResult:
        """One step over microbatches; {"loss", "outputs"}. Forwards and backwards; forwards only (evaluation) under
        torch.no_grad() or with the model in eval mode and no optimizer. `criterion(outputs, micro_batch)` returns
        the microbatch's scalar loss (needed to train)."""
        return self.plugin.execute_pipeline(data_iter, model, criterion, optimizer, return_loss, return_outputs)

    def no_sync(self, model: Optional[nn.Module] = None, optimizer=None) -> ContextManager[None]:
        """Gradient accumulation: backward passes inside accumulate locally; the data-parallel reduction starts in
        the first backward outside (or at optimizer.step())."""
        return self.plugin.no_sync(model, optimizer)

    # -- checkpoints (ColossalAI's signatures; see checkpoint/). Collective: call on every rank. ------------
    @property
    def checkpoint_io(self) -> BoosterCheckpointIO:
        if getattr(self, "_checkpoint_io", None) is None:
            self._checkpoint_io = self.plugin.get_checkpoint_io()
        return self._checkpoint_io

    def save_model(self, model: nn.Module, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                   prefix: Optional[str] = None, size_per_shard: int = 1024, use_safetensors: bool = False,
                   use_async: bool = False) -> None:
        """Write the full, unsharded model (atomically). `checkpoint` ending in `.safetensors` (or `.pt`/`.bin`)
        with shard=False: one file there. Any other path, and shard=True whatever the suffix (as ColossalAI: a
        directory named `model.bin`): a Hugging Face directory, `model.safetensors` (shard=False)
        or `model-0000i-of-0000n.safetensors` + index (shard=True, files of about `size_per_shard` MB), with
        `config.json`. Every tensor carries a CRC32. `use_async=True` returns once the tensors are gathered and
        copied; the files are written in the background (see `checkpoint_io.synchronize()`)."""
        self.plugin.arrive("save_model")
        self.checkpoint_io.save_model(model, checkpoint, shard=shard, gather_dtensor=gather_dtensor, prefix=prefix,
                                      size_per_shard=size_per_shard, use_safetensors=use_safetensors,
                                      use_async=use_async)

    def load_model(self, model: nn.Module, checkpoint: str, strict: bool = True, low_cpu_mem_mode: bool = True,
                   num_threads: int = 1, *, verify_checksums: bool = True) -> None:
        """Load a checkpoint (ours, any HF safetensors directory or file, or a `.pt`/`.bin` state dict read with
        weights_only=True) into the boosted model of any layout; each rank reads only its slices and verifies their
        checksums. On any error every rank raises CheckpointError and no parameter changes."""
        self.plugin.arrive("load_model")
        self.checkpoint_io.load_model(model, checkpoint, strict=strict, low_cpu_mem_mode=low_cpu_mem_mode,
                                      num_threads=num_threads, verify_checksums=verify_checksums)

    def save_optimizer(self, optimizer, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                       prefix: Optional[str] = None, size_per_shard: int = 1024, use_async: bool = False) -> None:
        """Write the optimizer state into directory `checkpoint`: one safetensors + JSON per (stage, tp rank),
        keyed by parameter names, and optimizer.index.json (layout, files, checksums)."""
        self.plugin.arrive("save_optimizer")
        self.checkpoint_io.save_optimizer(optimizer, checkpoint, shard=shard, gather_dtensor=gather_dtensor,
                                          prefix=prefix, size_per_shard=size_per_shard, use_async=use_async)

    def load_optimizer(self, optimizer, checkpoint: str, prefix: Optional[str] = None, low_cpu_mem_mode: bool = True,
                       num_threads: int = 1, *, strict: bool = True, verify_checksums: bool = True) -> None:
        """Load optimizer state saved by save_optimizer from any layout, param groups matched by parameter name;
        state for parameters the model lacks is refused (strict=False: skipped with a warning)."""
        self.plugin.arrive("load_optimizer")
        self.checkpoint_io.load_optimizer(optimizer, checkpoint, prefix=prefix, low_cpu_mem_mode=low_cpu_mem_mode,
                                          num_threads=num_threads, strict=strict, verify_checksums=verify_checksums)

    def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        """Write the scheduler's state_dict to the JSON file `checkpoint` (rank 0, atomically)."""
        self.plugin.arrive("save_lr_scheduler")
        self.checkpoint_io.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        self.plugin.arrive("load_lr_scheduler")
        self.checkpoint_io.load_lr_scheduler(lr_scheduler, checkpoint)


def _check_plugin(plugin: object) -> None:
    if not isinstance(plugin, Plugin):
        raise TypeError(f"plugin must be a HybridParallelPlugin, LowLevelZeroPlugin or TorchDDPPlugin (a booster_plugin "
                        f"Plugin), got {type(plugin).__name__}.")
