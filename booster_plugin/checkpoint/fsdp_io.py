"""FSDPCheckpointIO: checkpoints of a model boosted by GeminiPlugin or TorchFSDPPlugin (torch FSDP2).

torch's own state-dict helpers (through fsdp_state.py) move the tensors between the shards and full tensors
(`torch.distributed.checkpoint.state_dict`: `get_model_state_dict` / `get_optimizer_state_dict` with
`full_state_dict=True, cpu_offload=True` gather the full tensors onto rank 0; `set_model_state_dict` /
`set_optimizer_state_dict` with `full_state_dict=True` keep each rank's slice of the full tensors given). Files are
ours, written through the same atomic save sequence (save.collective_save) as every plugin's:

- model: Hugging Face format, loadable with `from_pretrained`: a directory with `model.safetensors` (shard=False) or
  `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` (shard=True, files of about `size_per_shard`
  MB), and `config.json`; or one `.safetensors` (`.pt`/`.bin`) file given by its path. The full-precision (fp32)
  sharded parameters are saved whatever the compute dtype. Every rank loads the whole checkpoint and keeps its
  slices (any HF safetensors directory, index or file).
- optimizer: the full optimizer state keyed by parameter name (torch's full optimizer state dict), in directory
  `checkpoint`: `optimizer.safetensors` (tensors, `<name>/<state key>`) + `optimizer.json` (param groups, other
  values, the fp16 loss scale); never pickled. It loads into any number of ranks.
- lr scheduler: as every plugin's (JSON).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ..core.mixed_precision import DynamicLossScaler
from ..core.optimizer_wrapper import OptimizerWrapper
from ..fsdp.model import fsdp_module, hf_class_name
from ..fsdp.state import full_model_state, full_optimizer_state, load_full_optimizer_state
from .atomic import replace_file, resolve_dir, swap_into_place
from .ddp_io import OPTIMIZER_JSON, OPTIMIZER_TENSORS, TorchDDPCheckpointIO, _no_commit, _tied_targets, read_state
from .format import (TORCH_SUFFIXES, Entry, from_json, read_json, to_json, write_json,
                     write_tensor_file)
from .jobs import agree, describe, listed
from .gather import TensorPlan
from .model import FILE_SUFFIXES
from .model_save import file_plan, save_config, write_index
from .reads import TensorReads, guarded_read
from .save import LocalPhase, collective_save

__all__ = ["FSDPCheckpointIO"]

_SCATTER = StateDictOptions(full_state_dict=True, strict=False)      # each rank keeps its slices of full tensors
_FORMAT = "fsdp-full-state-dict"


class FSDPCheckpointIO(TorchDDPCheckpointIO):
    """Collective checkpoint calls for models boosted by the FSDP2 plugins (every rank calls each)."""

    # -- model ---------------------------------------------------------------------------------------------------
    def save_model(self, model: nn.Module, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                   prefix: Optional[str] = None, size_per_shard: float = 1024, use_safetensors: bool = False,
                   use_async: bool = False) -> None:
        """The full model, gathered onto rank 0, which writes it (module docstring). `use_async=True` returns once
        the tensors are gathered; the files are written in the background."""
        self.synchronize()
        module = fsdp_module(model)
        if not gather_dtensor:
            raise NotImplementedError("gather_dtensor=False is not supported: models are saved unsharded.")
        path = os.fspath(checkpoint)
        single = path.endswith(FILE_SUFFIXES) and not shard
        layout = _ModelFiles(path, single, shard, f"{prefix}-" if prefix else "", size_per_shard)
        collective_save(self.context, f"save_model({checkpoint!r})", path,
                        lambda tmp: self._model_phase(module, layout, tmp, use_async),
                        single_file=single, use_async=use_async)

    def _model_phase(self, module: nn.Module, layout: "_ModelFiles", tmp: str, use_async: bool) -> LocalPhase:
        state = full_model_state(module, rank0_only=True)  # collective
        if self.context.rank != 0:
            return LocalPhase(commit=_no_commit)
        tied = _tied_targets(module)
        # buffers come back as the live tensors: copies, since training may go on during an asynchronous save
        state = {k: (t.detach().clone() if use_async else t.detach()) for k, t in state.items() if k not in tied}
        return LocalPhase(functools.partial(_commit_model, module, state, layout, tmp))

    def load_model(self, model: nn.Module, checkpoint: str, strict: bool = True, low_cpu_mem_mode: bool = True,
                   num_threads: int = 1, *, verify_checksums: bool = True) -> None:
        """Every rank reads the whole checkpoint (HF directory, index or one file) and checks its CRC32s, then keeps
        its slices; nothing changes on any rank unless every rank read everything. strict=False: missing and
        unexpected keys are skipped."""
        self.synchronize()
        module = fsdp_module(model)
        path = os.fspath(checkpoint)
        state, error = guarded_read(lambda reads: read_state(module, path, strict, reads), verify_checksums,
                                    num_threads)
        agree(error, f"load_model({checkpoint!r})", self.context.device)
        set_model_state_dict(module, state, options=_SCATTER)

    # -- optimizer -----------------------------------------------------------------------------------------------
    def save_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str, shard: bool = False,
                       gather_dtensor: bool = True, prefix: Optional[str] = None, size_per_shard: float = 1024,
                       use_async: bool = False) -> None:
        """The full optimizer state, gathered onto rank 0, into directory `checkpoint` (module docstring); `shard`,
        `gather_dtensor`, `prefix` and `size_per_shard` are accepted for ColossalAI compatibility."""
        self.synchronize()
        optim, module = _parts(optimizer)
        path = os.fspath(checkpoint)
        collective_save(self.context, f"save_optimizer({checkpoint!r})", path,
                        lambda tmp: self._optimizer_phase(optimizer, optim, module, tmp, path), use_async=use_async)

    def _optimizer_phase(self, optimizer: OptimizerWrapper, optim: torch.optim.Optimizer, module: nn.Module,
                         tmp: str, path: str) -> LocalPhase:
        state = full_optimizer_state(module, optim, rank0_only=True)  # collective
        if self.context.rank != 0:
            return LocalPhase(commit=_no_commit)
        try:
            tensors, meta = _optimizer_files(state, type(optim).__name__, getattr(optimizer, "scaler", None))
        except TypeError as error:
            return LocalPhase(commit=_no_commit, error=describe(error))
        return LocalPhase(functools.partial(_commit_optimizer, tensors, meta, tmp, path))

    def load_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str, prefix: Optional[str] = None,
                       low_cpu_mem_mode: bool = True, num_threads: int = 1, *, strict: bool = True,
                       verify_checksums: bool = True) -> None:
        """Every rank reads the state saved by save_optimizer (checksums verified) into an optimizer of the same type
        whose param groups hold the same parameters (by name), on any number of ranks; else every rank raises,
        nothing changed. `prefix`, `low_cpu_mem_mode` and `strict` are accepted for compatibility."""
        self.synchronize()
        optim, module = _parts(optimizer)
        path = os.fspath(checkpoint)
        loaded, error = guarded_read(lambda reads: _read_optimizer(optim, module, path, reads), verify_checksums,
                                     num_threads)
        agree(error, f"load_optimizer({checkpoint!r})", self.context.device)
        state, scaler_state = loaded
        load_full_optimizer_state(module, optim, state)
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None and scaler_state is not None:
            scaler.load_state_dict(scaler_state)

    def save_lora_as_pretrained(self, model: nn.Module, checkpoint: str, use_safetensors: bool = False) -> None:
        raise NotImplementedError("save_lora_as_pretrained is not supported with GeminiPlugin / TorchFSDPPlugin "
                                  "(ColossalAI's do not support LoRA either): use LowLevelZeroPlugin or "
                                  "HybridParallelPlugin.")


def _parts(optimizer: OptimizerWrapper) -> Tuple[torch.optim.Optimizer, nn.Module]:
    """The torch optimizer and the sharded model of a boosted FSDP optimizer."""
    model = getattr(optimizer, "model", None) if isinstance(optimizer, OptimizerWrapper) else None
    if model is None:
        raise TypeError(f"Expected the optimizer returned by booster.boost() with GeminiPlugin or TorchFSDPPlugin, "
                        f"got {type(optimizer).__name__}.")
    return optimizer.unwrap(), fsdp_module(model)


# -- model files ---------------------------------------------------------------------------------------------------
class _ModelFiles:
    """Where one save_model call writes (see model_save.py for the same rule)."""

    def __init__(self, path: str, single: bool, shard: bool, base: str, size_per_shard: float) -> None:
        self.path, self.single, self.shard, self.base = path, single, shard, base
        self.size_per_shard = size_per_shard

    def files(self, entries: List[Entry]) -> List[Tuple[str, List[Entry]]]:
        """[(file name, its entries)]: one file, or consecutive runs of about `size_per_shard` MB."""
        return file_plan(TensorPlan(entries, {e.name: 0 for e in entries}), self.shard, self.size_per_shard, self.base)


def _commit_model(module: nn.Module, state: Dict[str, torch.Tensor], layout: _ModelFiles, tmp: str) -> None:
    """Rank 0: the tensor files (index and config in a directory) into the temporary path, then swapped in."""
    entries = [Entry(k, tuple(t.shape), t.dtype) for k, t in state.items()]
    if layout.single:
        write_tensor_file(tmp, entries, iter(state.values()), layout.path.endswith(TORCH_SUFFIXES))
        replace_file(tmp, layout.path)
        return
    files = layout.files(entries)
    for name, file_entries in files:
        write_tensor_file(os.path.join(tmp, name), file_entries, (state[e.name] for e in file_entries))
    if layout.shard:
        write_index(tmp, layout.base, files, lambda name: name)
    save_config(module, tmp, entries)
    config = os.path.join(tmp, "config.json")
    if os.path.isfile(config):  # FSDP2 renamed the class (FSDPLlamaForCausalLM): the model's own name
        write_json(config, {**read_json(config, "config"), "architectures": [hf_class_name(module)]})
    swap_into_place(layout.path)


# -- optimizer files -----------------------------------------------------------------------------------------------
def _optimizer_files(state: Dict[str, Any], optimizer: str,
                     scaler: Optional[DynamicLossScaler]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """(tensors keyed `<parameter name>/<state key>`, the JSON) of a full optimizer state dict."""
    tensors: Dict[str, torch.Tensor] = {}
    values: Dict[str, Dict[str, Any]] = {}
    for name, param_state in state["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[f"{name}/{key}"] = value.detach().to("cpu", copy=True)
            elif isinstance(value, torch.Tensor):  # 0-d (Adam's step): exact in JSON, dtype kept
                values.setdefault(name, {})[key] = to_json(value.detach().cpu(), f"optimizer state {name}.{key}")
            else:
                values.setdefault(name, {})[key] = to_json(value, f"optimizer state {name}.{key}")
    meta = {"format": _FORMAT, "optimizer": optimizer, "param_groups": to_json(state["param_groups"], "param_groups"),
            "state": values, "loss_scaler": scaler.state_dict() if scaler is not None else None}
    return tensors, meta


def _commit_optimizer(tensors: Dict[str, torch.Tensor], meta: Dict[str, Any], tmp: str, path: str) -> None:
    entries = [Entry(k, tuple(t.shape), t.dtype) for k, t in tensors.items()]
    write_tensor_file(os.path.join(tmp, OPTIMIZER_TENSORS), entries, iter(tensors.values()))
    write_json(os.path.join(tmp, OPTIMIZER_JSON), meta)
    swap_into_place(path)


def _read_optimizer(optim: torch.optim.Optimizer, module: nn.Module, checkpoint: str,
                    reads: TensorReads) -> Tuple[Dict[str, Any], Optional[Dict[str, float]]]:
    """(the full optimizer state dict saved at `checkpoint`, the loss scaler's state), checked against `optim`."""
    directory = resolve_dir(checkpoint)
    meta = read_json(os.path.join(directory, OPTIMIZER_JSON), "optimizer checkpoint")
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{checkpoint} was not saved by GeminiPlugin / TorchFSDPPlugin (format "
                         f"{meta.get('format')!r}): load it with the plugin that saved it")
    if meta.get("optimizer") != type(optim).__name__:
        raise ValueError(f"{checkpoint} holds the state of a {meta.get('optimizer')}, the optimizer is a "
                         f"{type(optim).__name__}")
    groups = from_json(meta["param_groups"])
    names = {id(p): n for n, p in module.named_parameters()}
    mine = [[names.get(id(p), "?") for p in g["params"]] for g in optim.param_groups]
    saved = [list(g["params"]) for g in groups]
    if saved != mine:
        raise ValueError(f"{checkpoint} was saved for param groups of {[len(g) for g in saved]} parameters "
                         f"({listed(saved[0] if saved else [], 3)} ...), the optimizer's differ: build the optimizer "
                         f"the same way over the same model")
    state: Dict[str, Dict[str, Any]] = {n: {k: from_json(v) for k, v in s.items()} for n, s in meta["state"].items()}
    f = reads.open(os.path.join(directory, OPTIMIZER_TENSORS))
    for key in f.keys():
        name, state_key = key.rsplit("/", 1)
        state.setdefault(name, {})[state_key] = f.read(key)
        reads.expect(f, key, {})
    reads.verify()
    return {"state": state, "param_groups": groups}, meta.get("loss_scaler")
