"""Mistakes in how `boost` and `execute_pipeline` are called, refused before anything runs, naming the fix.

Each check depends only on the call's arguments (the same on every rank of a script) or, for the batch, runs where
`agree_on_batch` shares its verdict with every rank, so every rank raises the same error before any collective.
"""
from __future__ import annotations

import json

import hashlib
import weakref
from typing import Mapping

import torch
from torch import nn

from ..guards.batch_check import BatchLimits
from ..guards.launch import agree_on_values
from ..core.optimizer import HybridParallelOptimizer
from ..core.parallel_module import HybridParallelModule

__all__ = ["refuse_boosted_twice", "remember_boosted", "agree_on_model", "check_step_arguments", "check_criterion",
           "check_batch_content"]

_TOKEN_KEYS = ("input_ids", "inputs_embeds", "decoder_input_ids")
# the transformers models boost has sharded in place (weakly held: a dropped model is forgotten)
_SHARDED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def refuse_boosted_twice(model: nn.Module) -> None:
    """Refuse a model object `boost` has already sharded in place (its layers are now this rank's shards)."""
    if isinstance(model, HybridParallelModule):
        raise ValueError("This model is already boosted: use it as it is (boost returns it ready to train).")
    if model in _SHARDED:
        raise ValueError(f"This {type(model).__name__} object was boosted before: boost shards the model in place, so "
                         f"it cannot be boosted again. Use the model the first boost returned, or build a new one "
                         f"(e.g. from_pretrained again) to boost with another plugin.")


def remember_boosted(model: nn.Module) -> None:
    _SHARDED.add(model)


# config entries that describe where a config came from, not the model (save_pretrained sets `architectures` and
# `dtype` on the saving rank's config object only; the parameters' dtypes are compared themselves)
_CONFIG_METADATA = ("_name_or_path", "architectures", "transformers_version", "_commit_hash", "dtype", "torch_dtype")


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def agree_on_model(model: nn.Module) -> None:
    """Collective over the world, before boost shards anything: every rank must have built the same model (its
    parameters' names, shapes and dtypes, and its config), else the ranks would shard different layers and fail in
    a raw collective error on some ranks while others report success. One all-gather of four integers."""
    params = [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters(remove_duplicate=False)]
    config = getattr(model, "config", None)
    settings = {} if config is None else {k: v for k, v in config.to_dict().items() if k not in _CONFIG_METADATA}
    agree_on_values("The ranks built different models", "build the same model on every rank (the same config, e.g. "
                    "from_pretrained of the same checkpoint, or the same config arguments)",
                    {"parameters": len(params), "parameter names, shapes and dtypes (digest)": _digest("|".join(params)),
                     "config (digest)": _digest(json.dumps(_canonical(settings), default=repr))})


def _canonical(value: object) -> object:
    """`value` with every dict's items in key order at every depth (a config may build a nested dict from a set,
    whose order changes with each process's hash seed), keys as strings."""
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def check_step_arguments(model: object, criterion: object, optimizer: object) -> None:
    """execute_pipeline(data_iter, model, criterion, optimizer): the boosted model and optimizer, a callable
    criterion (or None)."""
    if not isinstance(model, HybridParallelModule):
        raise TypeError(f"execute_pipeline needs the model booster.boost returned, got {type(model).__name__}: call "
                        f"`model, optimizer, *_ = booster.boost(model, optimizer)` first and pass that model.")
    if isinstance(criterion, (HybridParallelOptimizer, torch.optim.Optimizer)):
        raise TypeError(f"execute_pipeline(data_iter, model, criterion, optimizer) got the optimizer "
                        f"({type(criterion).__name__}) as its criterion: pass the criterion before the optimizer, "
                        f"e.g. `booster.execute_pipeline(data_iter, model, lambda outputs, batch: outputs.loss, "
                        f"optimizer)`.")
    if criterion is not None and not callable(criterion):
        raise TypeError(f"criterion must be callable as criterion(outputs, micro_batch) -> scalar loss, got "
                        f"{type(criterion).__name__}; e.g. `lambda outputs, batch: outputs.loss`.")
    if optimizer is not None and not isinstance(optimizer, HybridParallelOptimizer):
        raise TypeError(f"execute_pipeline needs the optimizer booster.boost returned (it reduces the gradients over "
                        f"the ranks), got {type(optimizer).__name__}: `model, optimizer, *_ = booster.boost(model, "
                        f"optimizer)`.")


def check_criterion(criterion: object, trains: bool) -> None:
    """A step that runs backward needs a loss: refuse criterion=None there."""
    if criterion is None and trains:
        raise ValueError("execute_pipeline trains here (gradients are enabled and the model is in train mode or an "
                         "optimizer is given), which needs a loss: pass criterion=lambda outputs, batch: outputs.loss "
                         "(or your own). To run forwards only without a loss, call it under torch.no_grad(), or "
                         "after model.eval() without an optimizer.")


def check_batch_content(batch: object, limits: BatchLimits) -> None:
    """Refuse an empty batch, and labels that are not token ids for a model whose labels index its vocabulary (an
    LM head). Other problems (not a dict, shapes) are left to the split."""
    if not isinstance(batch, Mapping):
        return
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        if value.shape[0] == 0 or (key in _TOKEN_KEYS and value.dim() > 1 and value.shape[1] == 0):
            raise ValueError(f"The batch is empty: {key!r} has shape {tuple(value.shape)}. Skip empty batches before "
                             f"execute_pipeline (e.g. drop the empty last batch of an epoch with drop_last=True, or "
                             f"filter out empty samples).")
    labels = batch.get("labels")
    if limits.label_vocab is not None and isinstance(labels, torch.Tensor) and \
            (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool):
        raise TypeError(f"labels have dtype {labels.dtype}, but this model's labels are token ids of its vocabulary: "
                        f"pass integer labels (e.g. labels.long()), with ignore_index -100 for tokens without a loss.")
