"""TorchDDPCheckpointIO: checkpoints of a model boosted by TorchDDPPlugin (torch DistributedDataParallel).

Every rank holds the whole model, so rank 0 writes it, in the same Hugging Face format and through the same atomic
save sequence (save.collective_save) as HybridParallelCheckpointIO: `model.safetensors` + `config.json` in a
directory (`from_pretrained` loads it), or one `.safetensors` / `.pt` file. Every rank loads the whole model
(any HF safetensors directory, index or file). Optimizer state is torch's state_dict, as ColossalAI's TorchDDPCheckpointIO saves it
(keyed by parameter index: it loads into an optimizer built the same way over the same model), written by rank 0
as `optimizer.safetensors` (tensors) + `optimizer.json` (param groups and other values), never pickled. lr
scheduler checkpoints are HybridParallelCheckpointIO's.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..core.ddp_model import ddp_module as ddp_wrapper
from ..core.optimizer_wrapper import OptimizerWrapper
from .atomic import replace_file, resolve_dir, swap_into_place
from .context import CheckpointContext
from .format import TORCH_SUFFIXES, Entry, from_json, read_json, to_json, write_json, write_tensor_file
from .io import HybridParallelCheckpointIO
from .jobs import agree, describe, listed
from .model import FILE_SUFFIXES
from .model_load import locate
from .gather import TensorPlan
from .model_save import file_plan, save_config, write_index
from .reads import TensorReads, guarded_read
from .save import LocalPhase, collective_save

__all__ = ["TorchDDPCheckpointIO", "ddp_context"]

OPTIMIZER_TENSORS, OPTIMIZER_JSON = "optimizer.safetensors", "optimizer.json"


def ddp_context(device: torch.device, timeout_s: float) -> CheckpointContext:
    """The layout of plain data parallel over the world: one stage, no tp, rank 0 writes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return CheckpointContext(device=device, rank=rank, stage=0, num_stages=1, tp_rank=0, tp_size=1, dp_rank=rank,
                             dp_size=world, timeout_s=timeout_s, stage_writers=((0,),))


def ddp_module(model: nn.Module) -> nn.Module:
    """The original model inside the TorchDDPModel that TorchDDPPlugin's boost returned (under torch AMP too)."""
    return ddp_wrapper(model).module


def _tied_targets(module: nn.Module) -> Dict[str, str]:
    """{tied target: its source} (transformers re-ties the targets on load, so they are not saved)."""
    keys = getattr(module, "all_tied_weights_keys", None)
    return dict(keys) if isinstance(keys, dict) else {}


class TorchDDPCheckpointIO(HybridParallelCheckpointIO):
    """Collective checkpoint calls for models boosted by TorchDDPPlugin (every rank calls each)."""

    def save_model(self, model: nn.Module, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                   prefix: Optional[str] = None, size_per_shard: float = 1024, use_safetensors: bool = False,
                   use_async: bool = False) -> None:
        """Rank 0 writes the model's state dict (tied targets left out): a `.safetensors` (or `.pt`/`.bin`) path is
        one file, any other path an HF directory (`model.safetensors`, `config.json`). `use_async=True` returns once
        the tensors are copied. shard=True writes a directory (whatever the path's suffix, as ColossalAI) of
        safetensors files of at most `size_per_shard` MB and `model.safetensors.index.json`."""
        self.synchronize()
        module = ddp_module(model)
        path = os.fspath(checkpoint)
        single = path.endswith(FILE_SUFFIXES) and not shard
        base = f"{prefix}-" if prefix else ""
        collective_save(self.context, f"save_model({checkpoint!r})", path,
                        lambda tmp: self._snapshot(module, tmp, path, None if single else (base, shard,
                                                                                          size_per_shard)),
                        single_file=single, use_async=use_async)

    def _snapshot(self, module: nn.Module, tmp: str, path: str,
                  files: Optional[Tuple[str, bool, float]]) -> LocalPhase:
        """Rank 0: copies of the tensors (training may go on during an asynchronous save) and the commit; `files`:
        (name prefix, sharded, MB per file) of a directory, None for one file."""
        if self.context.rank != 0:
            return LocalPhase(commit=_no_commit)
        tied = _tied_targets(module)
        state = {k: t.detach().to("cpu", copy=True) for k, t in module.state_dict().items() if k not in tied}
        entries = [Entry(k, tuple(t.shape), t.dtype) for k, t in state.items()]
        layout = None
        if files is not None:
            base, shard, size = files
            layout = file_plan(TensorPlan(entries, {e.name: 0 for e in entries}), shard, size, base)
        return LocalPhase(functools.partial(_commit, module, state, entries, tmp, path, layout, files))

    def load_model(self, model: nn.Module, checkpoint: str, strict: bool = True, low_cpu_mem_mode: bool = True,
                   num_threads: int = 1, *, verify_checksums: bool = True) -> None:
        """Every rank reads the whole model (HF directory, index or one file) and checks its CRC32s; nothing changes
        on any rank unless every rank read everything. strict=False: missing and unexpected keys are skipped."""
        self.synchronize()
        module = ddp_module(model)
        path = os.fspath(checkpoint)
        pending, error = guarded_read(lambda reads: _read(module, path, strict, reads), verify_checksums,
                                      num_threads)
        agree(error, f"load_model({checkpoint!r})", self.context.device)
        with torch.no_grad():
            for target, value in pending:
                target.copy_(value)

    def save_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str, shard: bool = False,
                       gather_dtensor: bool = True, prefix: Optional[str] = None, size_per_shard: float = 1024,
                       use_async: bool = False) -> None:
        """Rank 0 writes the optimizer's state_dict into directory `checkpoint` (module docstring); `shard`,
        `gather_dtensor`, `prefix` and `size_per_shard` are accepted for ColossalAI compatibility and do not change
        that. `use_async=True` returns once the tensors are copied."""
        self.synchronize()
        optim = _torch_optimizer(optimizer)
        path = os.fspath(checkpoint)
        collective_save(self.context, f"save_optimizer({checkpoint!r})", path,
                        lambda tmp: self._optimizer_snapshot(optim, tmp, path), use_async=use_async)

    def _optimizer_snapshot(self, optim: torch.optim.Optimizer, tmp: str, path: str) -> LocalPhase:
        """Rank 0: copies of the state's tensors, its other values as JSON, and the commit."""
        if self.context.rank != 0:
            return LocalPhase(commit=_no_commit)
        state = optim.state_dict()
        tensors: Dict[str, torch.Tensor] = {}
        values: Dict[str, Dict[str, Any]] = {}
        try:
            for index, param_state in state["state"].items():
                for name, value in param_state.items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"{index}.{name}"] = value.detach().to("cpu", copy=True)
                    else:
                        values.setdefault(str(index), {})[name] = to_json(value, f"optimizer state {index}.{name}")
            meta = {"optimizer": type(optim).__name__, "param_groups": to_json(state["param_groups"], "param_groups"),
                    "state": values}
        except TypeError as error:
            return LocalPhase(commit=_no_commit, error=describe(error))
        return LocalPhase(functools.partial(_commit_optimizer, tensors, meta, tmp, path))

    def load_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str, prefix: Optional[str] = None,
                       low_cpu_mem_mode: bool = True, num_threads: int = 1, *, strict: bool = True,
                       verify_checksums: bool = True) -> None:
        """Every rank loads the state_dict saved by save_optimizer (checksums verified) into an optimizer of the
        same type with param groups of the same sizes (else every rank raises, nothing changed). `prefix`,
        `low_cpu_mem_mode` and `strict` are accepted for compatibility: the state is keyed by parameter index,
        so it loads whole."""
        self.synchronize()
        optim = _torch_optimizer(optimizer)
        path = os.fspath(checkpoint)
        state, error = guarded_read(lambda reads: _read_optimizer(optim, path, reads), verify_checksums,
                                    num_threads)
        agree(error, f"load_optimizer({checkpoint!r})", self.context.device)
        optim.load_state_dict(state)

    def save_lora_as_pretrained(self, model: nn.Module, checkpoint: str, use_safetensors: bool = False) -> None:
        raise NotImplementedError("save_lora_as_pretrained is not supported with TorchDDPPlugin: use "
                                  "LowLevelZeroPlugin or HybridParallelPlugin, or call "
                                  "model.module.save_pretrained(checkpoint) on rank 0 (peft's own format).")


def _no_commit() -> None:
    """Ranks other than 0 neither write nor commit."""


def _commit(module: nn.Module, state: Dict[str, torch.Tensor], entries: List[Entry], tmp: str, path: str,
            layout: Optional[List[Tuple[str, List[Entry]]]], files: Optional[Tuple[str, bool, float]]) -> None:
    """Rank 0: the tensors (and config, and with several files their index) into the temporary path, then swapped
    into place."""
    if layout is None:
        write_tensor_file(tmp, entries, iter(state.values()), path.endswith(TORCH_SUFFIXES))
        replace_file(tmp, path)
        return
    for file_name, file_entries in layout:
        write_tensor_file(os.path.join(tmp, file_name), file_entries, (state[e.name] for e in file_entries))
    if files[1]:  # sharded: the index
        write_index(tmp, files[0], layout, lambda name: name)
    save_config(module, tmp, entries)
    swap_into_place(path)


def _torch_optimizer(optimizer: OptimizerWrapper) -> torch.optim.Optimizer:
    if isinstance(optimizer, OptimizerWrapper):
        return optimizer.unwrap()
    raise TypeError(f"Expected the optimizer returned by booster.boost() with TorchDDPPlugin (an OptimizerWrapper), "
                    f"got {type(optimizer).__name__}.")


def _commit_optimizer(tensors: Dict[str, torch.Tensor], meta: Dict[str, Any], tmp: str, path: str) -> None:
    """Rank 0: the tensors and the JSON into the temporary directory, then swapped into place."""
    entries = [Entry(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    write_tensor_file(os.path.join(tmp, OPTIMIZER_TENSORS), entries, iter(tensors.values()))
    write_json(os.path.join(tmp, OPTIMIZER_JSON), meta)
    swap_into_place(path)


def _read_optimizer(optim: torch.optim.Optimizer, checkpoint: str, reads: TensorReads) -> Dict[str, Any]:
    """The state_dict saved at `checkpoint`, checked against `optim`; raises on a problem."""
    directory = resolve_dir(checkpoint)
    meta = read_json(os.path.join(directory, OPTIMIZER_JSON), "optimizer checkpoint")
    if meta.get("optimizer") != type(optim).__name__:
        raise ValueError(f"{checkpoint} holds the state of a {meta.get('optimizer')}, the optimizer is a "
                         f"{type(optim).__name__}")
    groups = from_json(meta["param_groups"])
    saved, mine = [len(g["params"]) for g in groups], [len(g["params"]) for g in optim.param_groups]
    if saved != mine:
        raise ValueError(f"{checkpoint} was saved for param groups of {saved} parameters, the optimizer has {mine}: "
                         f"build the optimizer the same way over the same model")
    state: Dict[int, Dict[str, Any]] = {int(i): {k: from_json(v) for k, v in s.items()}
                                        for i, s in meta["state"].items()}
    f = reads.open(os.path.join(directory, OPTIMIZER_TENSORS))
    for key in f.keys():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = f.read(key)
        reads.expect(f, key, {})
    reads.verify()
    return {"state": state, "param_groups": groups}


def _read(module: nn.Module, checkpoint: str, strict: bool,
          reads: TensorReads) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """(model tensor, its checkpoint value) for every key the checkpoint has; raises on a problem."""
    own = module.state_dict()
    return [(own[key], value) for key, value in read_state(module, checkpoint, strict, reads).items()]


def read_state(module: nn.Module, checkpoint: str, strict: bool, reads: TensorReads) -> Dict[str, torch.Tensor]:
    """{key: checkpoint tensor} for every key of the model's state dict the checkpoint has (shapes checked against
    the state dict's: DTensors give their full shape), checksums verified; tied targets may be absent; `strict`:
    a missing or unexpected key is an error."""
    files = locate(checkpoint)
    own = module.state_dict()
    tied = _tied_targets(module)
    missing = [k for k in own if k not in files.weight_map and k not in tied]
    unexpected = [k for k in files.weight_map if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(f"{checkpoint} does not match the model: missing {listed(missing)}, unexpected "
                       f"{listed(unexpected)} (load_model(..., strict=False) skips them)")
    state = {}
    for key in own:
        if key not in files.weight_map:
            continue
        f = reads.open(os.path.join(files.directory, files.weight_map[key]))
        value = f.read(key)
        if tuple(value.shape) != tuple(own[key].shape):
            raise ValueError(f"{f.path}: tensor {key!r} has shape {tuple(value.shape)}, the model's is "
                             f"{tuple(own[key].shape)}")
        reads.expect(f, key, files.checksums)
        state[key] = value
    reads.verify()
    return state
