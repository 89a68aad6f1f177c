"""save_model: the full, unsharded model in Hugging Face format, from any (tp, pp, dp) layout.

Where it writes (the decision rule):
- `shard=False` and a path ending in `.safetensors`: ONE safetensors file at that path (no config);
  ending in `.pt` / `.pth` / `.bin`: one `torch.save`d dict of plain tensors (loaded with `weights_only=True`).
- `shard=True` (whatever the path's suffix, as ColossalAI: "out/model.bin" is a directory) or any other path: an HF
  directory — `model.safetensors` (shard=False) or `model-0000i-of-0000n.safetensors` +
  `model.safetensors.index.json` (shard=True), `config.json`, `generation_config.json`; `from_pretrained` loads it.
Vocab padding is stripped, fused areas (GPT-2's q|k|v) reassembled, tied targets not stored (transformers
re-ties them). A sharded file holds one stage's tensors, written by that stage's writer; a single file is written by
rank 0, which receives the other stages' tensors (gather.py).
"""
from __future__ import annotations

import copy
import functools
import os
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from torch import nn

from ..core.parallel_module import HybridParallelModule
from .atomic import replace_file, swap_into_place
from .context import CheckpointContext
from .format import CHECKSUM_KEY, TORCH_SUFFIXES, Entry, file_checksums, write_json, write_tensor_file
from .gather import TensorPlan, gathered, model_plan
from .jobs import describe
from .model import FILE_SUFFIXES, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, key_of
from .save import LocalPhase, collective_save


class ModelSave(NamedTuple):
    """What one save_model call writes, and where."""

    checkpoint: str
    plan: TensorPlan
    files: List[Tuple[str, List[Entry]]]  # (file name, its entries)
    shard: bool
    single: bool                          # one file at `checkpoint` (else a directory)
    torch_format: bool                    # that file is a torch.save'd dict
    prefix: str                           # of the directory's file names ("" or "<prefix>-")
    use_async: bool


def save_model(ctx: CheckpointContext, module: HybridParallelModule, checkpoint: str, shard: bool,
               gather_dtensor: bool, prefix: Optional[str], size_per_shard: float, use_async: bool) -> None:
    if not gather_dtensor:
        raise NotImplementedError("gather_dtensor=False is not supported: models are saved unsharded.")
    # shard=True always writes a directory, also one named like a file (as ColossalAI: "out/model.bin")
    single = checkpoint.endswith(FILE_SUFFIXES) and not shard
    torch_format = single and checkpoint.endswith(TORCH_SUFFIXES)
    plan = model_plan(ctx, module)
    base = f"{prefix}-" if prefix else ""
    save = ModelSave(checkpoint, plan, file_plan(plan, shard, size_per_shard, base), shard, single, torch_format,
                     base, use_async)
    collective_save(ctx, f"save_model({checkpoint!r})", checkpoint, lambda tmp: _gather_files(ctx, module, save, tmp),
                    single_file=single, use_async=use_async)


def file_plan(plan: TensorPlan, shard: bool, size_per_shard: float, base: str) -> List[Tuple[str, List[Entry]]]:
    """[(file name, its entries)]; a sharded file holds one stage's tensors only (one writer per file)."""
    if not shard:
        return [(base + SAFE_WEIGHTS_NAME, plan.entries)]
    limit = max(float(size_per_shard), 0.0) * 1024 * 1024
    files: List[List[Entry]] = []
    current: List[Entry] = []
    size, stage = 0, None
    for e in plan.entries:
        if current and (plan.stages[e.name] != stage or size + e.nbytes > limit):
            files.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
        stage = plan.stages[e.name]
    if current:
        files.append(current)
    n = len(files)
    return [(f"{base}model-{i + 1:05d}-of-{n:05d}.safetensors", f) for i, f in enumerate(files)]


def _gather_files(ctx: CheckpointContext, module: HybridParallelModule, save: ModelSave, tmp: str) -> LocalPhase:
    """The collective phase: each file's tensors gathered to its writer, which writes them now or (use_async)
    keeps snapshots for the background write."""
    stages, keyed_as = save.plan.stages, key_of(module)
    writers, snapshots, error = set(), [], None
    for file_name, file_entries in save.files:
        writer = ctx.writer_rank(stages[file_entries[0].name]) if save.shard else 0
        writers.add(writer)
        experts = module.info.expert_params
        if not (ctx.rank == writer or any(stages[e.name] == ctx.stage and ctx.gathers(e.name in experts)
                                          for e in file_entries)):
            continue
        stream = gathered(ctx, module, file_entries, stages, writer, snapshot=save.use_async)
        path = tmp if save.single else os.path.join(tmp, file_name)
        keyed = [Entry(keyed_as(e.name), e.shape, e.dtype) for e in file_entries]
        if ctx.rank == writer and error is None:
            try:
                if save.use_async:
                    snapshots.append((path, keyed, list(stream)))
                else:
                    write_tensor_file(path, keyed, stream, save.torch_format)
            except Exception as exc:
                error = describe(exc)
        for _ in stream:  # the rest of the collectives, whatever happened to the file
            pass

    def write() -> None:
        for path, entries, tensors in snapshots:
            write_tensor_file(path, entries, iter(tensors), save.torch_format)

    return LocalPhase(functools.partial(_commit, module, save, tmp), write, frozenset(writers), error)


def _commit(module: HybridParallelModule, save: ModelSave, tmp: str) -> None:
    """Rank 0, once every file is written: the index (shard=True) and config, then the swap."""
    if save.single:
        replace_file(tmp, save.checkpoint)
        return
    if save.shard:
        write_index(tmp, save.prefix, save.files, key_of(module))
    save_config(module.unwrap(), tmp, save.plan.entries)
    swap_into_place(save.checkpoint)


def write_index(directory: str, prefix: str, files: Sequence[Tuple[str, List[Entry]]],
                keyed_as: Callable[[str], str]) -> None:
    """`model.safetensors.index.json` of the written `files` [(file name, its entries)]: weight map, total size and
    each tensor's CRC32 (read back from the files)."""
    checksums: Dict[str, str] = {}
    for file_name, _ in files:
        checksums.update(file_checksums(os.path.join(directory, file_name)))
    write_json(os.path.join(directory, prefix + SAFE_WEIGHTS_INDEX_NAME), {
        "metadata": {"total_size": sum(e.nbytes for _, entries in files for e in entries)},
        "weight_map": {keyed_as(e.name): name for name, entries in files for e in entries},
        "checksums": {"algorithm": CHECKSUM_KEY, "tensors": checksums}})


def save_config(unwrapped: nn.Module, directory: str, entries: Sequence[Entry]) -> None:
    """The model's config.json (dtype: the saved tensors' most common floating dtype) and generation_config.json,
    so that `from_pretrained(directory)` loads the tensors."""
    config = getattr(unwrapped, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    floats = [e.dtype for e in entries if e.dtype.is_floating_point]
    if floats:
        config.dtype = max(set(floats), key=floats.count)
    config.architectures = [type(unwrapped).__name__]
    config.save_pretrained(directory)
    generation_config = getattr(unwrapped, "generation_config", None)
    can_generate = getattr(unwrapped, "can_generate", lambda: False)()
    if generation_config is not None and can_generate:
        generation_config.save_pretrained(directory)
