"""`from_pretrained` under LazyInitContext: transformers' own `from_pretrained` (config and its keyword arguments,
`dtype` / `torch_dtype`, the model class, keep-in-fp32 modules, key renamings, tied weights, generation config,
`eval()`, the loading report) with its two weight steps replaced while `lazy_loading()` is active:

- `_load_pretrained_model` reads the safetensors headers only. Each checkpoint key is renamed as transformers renames
  it; a tensor that goes to a parameter or buffer as it is stays on the meta device, in the dtype transformers would
  load it in, flagged as loaded, and the model remembers its file and key (`CheckpointSources`). Keys that
  transformers converts (fused experts, split qkv, extra state) are loaded by transformers itself, eagerly.
- `_finalize_model_loading` ties the weights and reports as transformers does, but leaves missing keys and
  non-persistent buffers on the meta device: `materialize` initializes them (the model's `_init_weights`, as
  `from_pretrained` initializes missing keys) and reads the others, each rank its own shard.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from shardformer.lazy_sources import attach_sources, sources_of, tensor_names

from .sources import CheckpointSources, TensorSource, same_values

__all__ = ["lazy_loading"]

logger = logging.getLogger("transformers.modeling_utils")  # transformers' own messages, under its logger
_EXTRA_STATE = nn.modules.module._EXTRA_STATE_KEY_SUFFIX


@contextlib.contextmanager
def lazy_loading() -> Iterator[None]:
    """Inside, `PreTrainedModel.from_pretrained` records where weights come from instead of loading them."""
    from transformers import PreTrainedModel

    names = ("_load_pretrained_model", "_finalize_model_loading")
    if not all(name in PreTrainedModel.__dict__ for name in names):
        import transformers

        raise NotImplementedError(f"from_pretrained under LazyInitContext hooks transformers' {names}, which "
                                  f"transformers {transformers.__version__} does not have (written for 5.24).")
    saved = {name: PreTrainedModel.__dict__[name] for name in names}
    PreTrainedModel._load_pretrained_model = staticmethod(_record_sources)
    PreTrainedModel._finalize_model_loading = staticmethod(_finalize_lazily)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(PreTrainedModel, name, value)


def _record_sources(model, state_dict, checkpoint_files, load_config, expected_keys=None):
    """Stands for `PreTrainedModel._load_pretrained_model`: (LoadStateDictInfo, disk offload index None)."""
    if state_dict is not None:  # tensors already in memory (from_pretrained(state_dict=...), an adapter): loaded
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        return convert_and_load_state_dict_in_model(model=model, state_dict=state_dict, load_config=load_config)
    _refuse_unsupported(checkpoint_files, load_config)
    shapes, paths = _read_headers(checkpoint_files)
    sources, eager, info = _plan(model, paths, load_config)
    if eager:
        _load_eagerly(model, eager, load_config, info)
    placed = _place(model, sources, shapes, load_config, info)
    model._weight_conversions = [c for c in (load_config.weight_mapping or []) if c.was_used()]
    attach_sources(model, CheckpointSources(placed))
    return info, None


def _refuse_unsupported(checkpoint_files, load_config) -> None:
    if not checkpoint_files or not all(str(f).endswith(".safetensors") for f in checkpoint_files):
        raise NotImplementedError(
            f"LazyInitContext loads safetensors checkpoints lazily (each rank reads its own slices); this checkpoint "
            f"is {checkpoint_files}: convert it to safetensors, or load it outside the context (its torch pickles "
            f"are read whole).")
    if load_config.hf_quantizer is not None or load_config.device_mesh is not None:
        raise NotImplementedError("from_pretrained under LazyInitContext does not quantize or shard with a device "
                                  "mesh (tp_plan): the plugin shards the model at boost.")
    devices = set((load_config.device_map or {}).values())
    if len(devices) > 1 or "disk" in devices:
        raise NotImplementedError(f"from_pretrained under LazyInitContext places the model at materialization; a "
                                  f"device_map over {sorted(map(str, devices))} is not supported.")


def _safe_open(path: str):
    """safetensors' `safe_open`, its errors naming the file (a truncated download says only "incomplete metadata")."""
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as error:  # truncated, corrupted header, not a safetensors file
        raise ValueError(f"from_pretrained under LazyInitContext: checkpoint file {path} is corrupted or truncated "
                         f"({error}); download it again.") from None


def _read_headers(checkpoint_files: List[str]) -> Tuple[Dict[str, Tuple[int, ...]], Dict[str, str]]:
    """({key: shape}, {key: file}) from the files' headers; no tensor is read."""
    shapes: Dict[str, Tuple[int, ...]] = {}
    paths: Dict[str, str] = {}
    for path in checkpoint_files:
        with _safe_open(path) as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
                paths[key] = str(path)
    return shapes, paths


def _plan(model, paths: Dict[str, str], load_config):
    """Which checkpoint key each parameter or buffer takes, renamed as `convert_and_load_state_dict_in_model` renames
    (the first key in its order wins): ({target: source}, {key: file} transformers converts, LoadStateDictInfo)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    from transformers.utils.loading_report import LoadStateDictInfo

    mapping = load_config.weight_mapping or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta_state = model.state_dict()
    prefix = model.base_model_prefix
    info = LoadStateDictInfo(missing_keys=set(meta_state), unexpected_keys=set(), mismatched_keys=set(),
                             error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    sources: Dict[str, TensorSource] = {}
    eager: Dict[str, str] = {}
    for key in sorted(paths, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if target not in meta_state and key in meta_state:
            target, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta_state)
        if pattern is not None or target.endswith(_EXTRA_STATE):
            eager[key] = paths[key]
        elif target in meta_state:
            sources.setdefault(target, TensorSource(paths[key], key))
        else:
            info.unexpected_keys.add(target)
    return sources, eager, info


def _load_eagerly(model, keys: Dict[str, str], load_config, info) -> None:
    """transformers loads (and converts) these checkpoint keys itself; its report is merged into `info`."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model

    with contextlib.ExitStack() as stack:
        files = {path: stack.enter_context(_safe_open(path))
                 for path in set(keys.values())}
        state = {key: files[path].get_slice(key) for key, path in keys.items()}
        done, _ = convert_and_load_state_dict_in_model(model=model, state_dict=state, load_config=load_config)
    info.missing_keys &= done.missing_keys
    info.unexpected_keys |= done.unexpected_keys
    info.mismatched_keys |= done.mismatched_keys
    info.conversion_errors.update(done.conversion_errors)
    info.error_msgs.extend(done.error_msgs)


def _place(model, sources: Dict[str, TensorSource], shapes: Dict[str, Tuple[int, ...]], load_config,
           info) -> Dict[str, TensorSource]:
    """Each target becomes a meta tensor as `set_param_for_module` would set it (the dtype transformers loads it in,
    a parameter unless it is a buffer, flagged as loaded); a shape mismatch is reported as transformers reports it.
    Returns the targets placed."""
    dtype_of = _dtype_rule(load_config)
    placed: Dict[str, TensorSource] = {}
    for target, source in sources.items():
        module_path, _, attr = target.rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        ref = getattr(module, attr)
        info.missing_keys.discard(target)
        if ref is None:
            info.unexpected_keys.add(target)
            continue
        shape = torch.Size(shapes[source.key])
        if shape != ref.shape:
            info.mismatched_keys.add((target, shape, ref.shape))
            continue
        dtype = dtype_of(target, ref.dtype)
        value = torch.empty(shape, dtype=dtype, device="meta")
        if attr not in module._buffers:
            value = nn.Parameter(value, requires_grad=dtype.is_floating_point)
        value._is_hf_initialized = True
        setattr(module, attr, value)
        placed[target] = source
    return placed


def _dtype_rule(load_config):
    """(target name, the meta tensor's dtype) -> the dtype transformers loads the checkpoint tensor in."""
    from transformers.core_model_loading import build_glob_alternation

    plan = load_config.dtype_plan or {}
    if not plan:  # transformers casts to `dtype`, or to the tensor's own dtype where they differ: the latter
        return lambda target, current: current
    alternation, group_of, _ = build_glob_alternation(list(plan))

    def dtype_of(target: str, current: torch.dtype) -> torch.dtype:
        found = alternation.search(target)
        return plan[group_of[found.lastgroup]] if found is not None else current

    return dtype_of


def _finalize_lazily(model, load_config, loading_info):
    """Stands for `PreTrainedModel._finalize_model_loading`: tie and report; missing keys stay on meta."""
    from transformers.utils.loading_report import log_state_dict_report

    try:
        model.mark_tied_weights_as_initialized(loading_info)
        both = _tie_checkpoint_duplicates(model)
        missing = set(loading_info.missing_keys) | both
        model.tie_weights(missing_keys=missing, recompute_mapping=False)
        loading_info.missing_keys = missing - both
        _name_tied_sources(model)
        model._adjust_missing_and_unexpected_keys(loading_info)
    finally:
        log_state_dict_report(model=model, pretrained_model_name_or_path=load_config.pretrained_model_name_or_path,
                              ignore_mismatched_sizes=load_config.ignore_mismatched_sizes, loading_info=loading_info,
                              logger=logger)
    return loading_info


def _name_tied_sources(model) -> None:
    """A tied weight's checkpoint tensor under each of its names: a pipeline stage may hold it under the target's
    name only (the head on the last stage, the embedding on the first)."""
    sources: Optional[CheckpointSources] = sources_of(model)
    if sources is None:
        return
    for aliases in tensor_names(model).values():
        found = sources.find(aliases)
        if found is not None:
            for name in aliases:
                sources.entries.setdefault(name, sources.entries[found])


def _tie_checkpoint_duplicates(model) -> Set[str]:
    """Tied targets the checkpoint holds as well as their source. transformers ties them when the values are equal
    and otherwise unties them with a warning; the values are compared here, block by block. Returns the targets to
    tie (passed to `tie_weights` as if missing)."""
    sources: Optional[CheckpointSources] = sources_of(model)
    entries = sources.entries if sources is not None else {}
    tie: Set[str] = set()
    for target, source in list(getattr(model, "all_tied_weights_keys", {}).items()):
        if target not in entries or source not in entries:
            continue
        if same_values(entries[target], entries[source]):
            tie.add(target)
            continue
        logger.warning(f"The tied weights mapping and config for this model specifies to tie {source} to {target}, "
                       f"but both are present in the checkpoints with different values, so we will NOT tie them. You "
                       f"should update the config with `tie_word_embeddings=False` to silence this warning.")
        model.all_tied_weights_keys.pop(target)
    return tie
