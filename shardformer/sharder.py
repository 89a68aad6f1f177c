"""Sharder: applies a policy to a model in place — release what this pipeline stage does not hold, replace modules
with tensor-parallel ones, re-tie shared weights — and returns what the runtime needs to drive the stage."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .layer.replicated import sum_grad_over_tp
from .layer.spec import TPSpec, get_tp_spec, shard_parameter, zero_padding
from .regions import enter_tp_regions_once
from .sequence_parallel import (SEQUENCE_DIM, apply_sequence_parallelism, check_sequence_parallelism, inside_layers,
                                sequence_span)
from .lora import check_lora_layers
from .policies.base import (Colwise, Experts, GradAllReduce, HeadEmbedding, KVHeads, Policy, Rowwise, SharedTailGrad,
                            SplitParam, VocabEmbedding, VocabHead, match)
from .stage import (ChunkView, Released, StageForward, get_submodule_parent, held_layer_list, replace_submodule,
                    stand_in_for)


@dataclass
class ShardConfig:
    """How to shard: the tp group (None = no TP), the pipeline stage manager (None = no PP) and TP options;
    `enable_sequence_parallelism` splits the sequence over the tp group (`sequence_parallelism_mode`
    "split_gather", the default, or "all_to_all"; see sequence_parallel.py)."""
    tensor_parallel_process_group: Optional[dist.ProcessGroup] = None
    pipeline_stage_manager: Optional[object] = None
    parallel_output: bool = True
    make_vocab_size_divisible_by: int = 64
    rng_tracker: Optional[object] = None
    enable_sequence_parallelism: bool = False
    sequence_parallelism_mode: Optional[str] = None

    @property
    def tp_size(self) -> int:
        group = self.tensor_parallel_process_group
        return 1 if group is None else dist.get_world_size(group)

    @property
    def sp_mode(self) -> Optional[str]:
        """The sequence parallelism mode in effect, None without it."""
        if not self.enable_sequence_parallelism:
            return None
        return self.sequence_parallelism_mode or "split_gather"


class Sharder:
    def __init__(self, model: nn.Module, policy: Policy, shard_config: ShardConfig) -> None:
        self.model = model
        self.policy = policy
        self.shard_config = shard_config
        self.stage_forward: Optional[StageForward] = None
        policy.set_model(model)
        policy.set_shard_config(shard_config)
        policy.set_pipeline_stage_manager(shard_config.pipeline_stage_manager)

    def shard(self) -> List[Dict[int, str]]:
        """Shard in place; returns the shared parameters as [{stage: parameter name on that stage}]."""
        self.policy.check_paths()
        self.policy.check_tp(self.model.config, self.shard_config.tp_size)
        mode = self.shard_config.sp_mode
        if mode is not None:
            check_sequence_parallelism(self.policy, mode, self.model.config, self.shard_config.tp_size)
        span = sequence_span(self.policy) if mode is not None else None  # before this stage keeps its own modules
        if self.shard_config.tp_size > 1:  # on the unsharded model, every rank alike, before any collective
            check_lora_layers(self.model, self._style_of)
        tied = self._tied_names()
        shared = self.policy.shared_param_names() if self.shard_config.pipeline_stage_manager else []
        if self.shard_config.pipeline_stage_manager is not None:
            self._release_unheld_layers()
        if self.shard_config.tp_size > 1:
            self._replace_modules()
            self._retie(tied)
            enter_tp_regions_once(self.model, self.policy, self.shard_config.tensor_parallel_process_group,
                                  SEQUENCE_DIM if mode == "split_gather" else None)
            self._change_attributes()
            self._use_tracker_rng()
            if mode is not None:
                apply_sequence_parallelism(self.model, self.policy, span, mode,
                                           self.shard_config.tensor_parallel_process_group)
        return shared

    # -- lazy initialization -----------------------------------------------------------------------------
    @torch.no_grad()
    def _materialize(self, device, init: bool = True) -> int:
        """Allocate the meta parameters and buffers this rank still holds (after sharding) on `device`.

        A model built under `torch.device("meta")` costs no memory; after `shard()` only this rank's shard is left,
        so allocating here keeps the peak near the shard's size. With `init`, the new tensors are initialized with
        the model's own `_init_weights` (HF's scheme; tensor-parallel layers through a native-class view of their
        shard, vocab padding zeroed; buffers such as rotary `inv_freq` recomputed). Replicated parameters differ
        between tp ranks here: the plugin's `sync_params` then broadcasts them over tp (and everything over dp).
        Non-meta tensors are left untouched. Returns the number of bytes allocated; 0 when nothing was on meta.
        """
        device = torch.device(device)
        new_of: Dict[int, torch.Tensor] = {}
        keep_alive: List[torch.Tensor] = []  # ids of replaced tensors must stay unique while new_of is in use
        for module in self.model.modules():
            for store in (module._parameters, module._buffers):
                for key, t in list(store.items()):
                    if t is None or not t.is_meta:
                        continue
                    new = new_of.get(id(t))
                    if new is None:
                        data = torch.empty(t.shape, dtype=t.dtype, device=device)
                        if isinstance(t, nn.Parameter):
                            new = nn.Parameter(data, requires_grad=t.requires_grad)
                            new.__dict__.update({k: v for k, v in t.__dict__.items()
                                                 if k not in ("_is_hf_initialized", "_grad_summed_over_tp")})
                            if getattr(t, "_grad_summed_over_tp", False):  # its gradient hook stays with `t`
                                sum_grad_over_tp(new, self.shard_config.tensor_parallel_process_group)
                        else:
                            new = data
                        new_of[id(t)] = new
                        keep_alive.append(t)
                    store[key] = new
        if not new_of:
            return 0
        materialized = {id(t) for t in new_of.values()}
        if init:
            self._init_materialized(materialized, device)
        return sum(t.numel() * t.element_size() for t in new_of.values())

    def _init_materialized(self, materialized, device) -> None:
        """HF's per-module init (children before parents, like `initialize_weights`) on the new tensors only."""
        from .layer import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

        try:
            from transformers import PreTrainedModel
            from transformers import initialization as hf_init
            guard = hf_init.guard_torch_init_functions
        except ImportError:  # plain torch models: reset_parameters only
            PreTrainedModel, guard = None, None
        # other tensors are flagged as initialized, so HF's guarded init functions leave them alone
        flagged = [t for m in self.model.modules() for t in (*m._parameters.values(), *m._buffers.values())
                   if t is not None and id(t) not in materialized and not getattr(t, "_is_hf_initialized", False)]
        for t in flagged:
            t._is_hf_initialized = True
        sm = self.shard_config.pipeline_stage_manager
        group = self.shard_config.tensor_parallel_process_group
        stage = sm.stage if sm is not None else 0
        tp_rank = dist.get_rank(group) if group is not None else 0
        # distinct draws per stage and tp rank (identical shards would make tp halves of a layer symmetric)
        seed = (torch.initial_seed() + 1_000_003 * stage + 7_919 * tp_rank) % (2 ** 63)
        devices = [device] if device.type not in ("cpu", "meta") else []
        try:
            with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"), \
                    (guard() if guard is not None else _nullcontext()):
                torch.manual_seed(seed)

                def visit(module: nn.Module, init_fn) -> None:
                    if PreTrainedModel is not None and isinstance(module, PreTrainedModel):
                        init_fn = module._init_weights
                    for child in module.children():
                        visit(child, init_fn)
                    if not any(id(t) in materialized for t in module.parameters()) and \
                            not any(id(t) in materialized for t in module.buffers()):
                        return
                    view = _native_view(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))
                    if init_fn is not None:
                        init_fn(view)
                    elif hasattr(module, "reset_parameters"):
                        module.reset_parameters()

                visit(self.model, None)
        finally:
            for t in flagged:
                del t._is_hf_initialized
        tp_world = dist.get_world_size(group) if group is not None else 1
        for p in self.model.parameters():  # vocab padding rows are zero, as sharding makes them
            if id(p) in materialized and get_tp_spec(p) is not None:
                zero_padding(p.data, get_tp_spec(p), tp_rank, tp_world)

    # -- pipeline ----------------------------------------------------------------------------------------
    def _release_unheld_layers(self) -> None:
        """Keep the layers of this rank's chunks (virtual stages), the entry modules where the first virtual stage
        is held (stand-ins elsewhere, and for this rank's other chunks), the exit and head where the last is."""
        policy, sm, model = self.policy, self.shard_config.pipeline_stage_manager, self.model
        release = getattr(policy, "release_unheld_layers", None)
        if release is not None:  # a policy with its own stage structure (encoder-decoder)
            self.stage_forward = release()
            return
        prefix = policy.base_prefix
        base = model.base_model
        ranges = sm.get_stage_index(policy.layers_per_stage(), num_model_chunks=sm.num_model_chunks)
        ranges = [ranges] if sm.num_model_chunks == 1 else ranges
        stages = sm.layout.stages_of(sm.stage)
        last = sm.layout.num_stages - 1
        layers = policy.layer_list()
        stand_ins: Dict[str, nn.Module] = {}
        for path, kind in policy.entry.items():
            parent, name = get_submodule_parent(base, path)
            if getattr(parent, name, None) is None:  # optional module this model does not have
                continue
            stand_ins[prefix + path] = stand_in_for(kind, base.get_submodule(path))
        if 0 not in stages:  # the stand-ins for good
            for path, module in stand_ins.items():
                replace_submodule(model, path, module)
        if last not in stages:
            for path in policy.exit:
                if getattr(*get_submodule_parent(base, path)) is not None:
                    replace_submodule(base, path, Released(prefix + path))
            for name in policy.head_modules():
                setattr(model, name, Released(name))
        if 0 in stages and len(stages) > 1 and stand_ins:  # swapped in for the other chunks
            # registered after the head's release (which takes every top-level module but the base model), so that
            # model.to(dtype) reaches them: their zeros, and the rotary tables built from them, follow the model
            model.pipeline_stand_ins = nn.ModuleDict({p.replace(".", "__"): m for p, m in stand_ins.items()})
        held = held_layer_list(layers, [i for start, end in ranges for i in range(start, end)])
        replace_submodule(model, prefix + policy.layers, held)
        chunks = []
        for stage, (start, end) in zip(stages, ranges):
            overrides = policy.stage_config_overrides(start, end)
            config = None
            if overrides:  # a chunk-local config view for the base model's loop; the model's own is untouched
                config = copy.copy(base.config)
                for key, value in overrides.items():
                    setattr(config, key, value)
            first_here = stage == 0 or 0 not in stages
            chunks.append(ChunkView(
                layer_keys=None if len(ranges) == 1 else [str(i) for i in range(start, end)],
                entry_layer=None if stage == 0 else layers[start],
                modules={} if first_here else stand_ins,
                exit_layer=None if stage == last else layers[end - 1], config=config))
        if sm.layout.num_stages > 1:
            self.stage_forward = StageForward(model, chunks, held, lambda: sm.model_chunk_id)

    # -- tensor parallel ---------------------------------------------------------------------------------
    def _tied_names(self) -> List[List[str]]:
        by_id: Dict[int, List[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        return [names for names in by_id.values() if len(names) > 1]

    def _replicated_layers(self, rel: str) -> bool:
        """all_to_all sequence parallelism keeps the layers' weights whole: no tp style or attribute inside them."""
        return self.shard_config.sp_mode == "all_to_all" and inside_layers(self.policy, rel)

    def _style_of(self, path: str):
        prefix = self.policy.base_prefix
        if path.startswith(prefix):
            if self._replicated_layers(path[len(prefix):]):
                return None
            for pattern, style in self.policy.tp_plan.items():
                if match(pattern, path[len(prefix):]):
                    return style
        for pattern, style in self.policy.head_tp_plan.items():
            if match(pattern, path):
                return style
        return None

    def _replace_modules(self) -> None:
        from .layer import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, padded_size,
                            vocab_parallel_lm_head)
        from .layer.head_embedding import HeadParallelEmbedding
        from .layer.experts import split_experts
        from .layer.replicated import keep_own_head, sum_grads_over_tp, sum_tail_grad_over_tp
        from .layer.vocab_split import shard_embedding_in_place
        from .layer.loss import parallel_causal_lm_loss
        from .lora import shards_adapters, shard_lora_layer

        cfg, group = self.shard_config, self.shard_config.tensor_parallel_process_group
        tp = cfg.tp_size
        multiple = cfg.make_vocab_size_divisible_by
        for path, module in list(self.model.named_modules()):
            style = self._style_of(path)
            if style is None or isinstance(module, Released) or not list(module.parameters()):
                continue
            if shards_adapters(module, style):
                shard_lora_layer(module, style, group, cfg.rng_tracker)  # base layer and adapters, in place
                continue
            if isinstance(style, Colwise):
                new = ColumnParallelLinear.from_native_module(module, group, gather_output=style.gather_output,
                                                              n_fused=style.n_fused)
            elif isinstance(style, Rowwise):
                new = RowParallelLinear.from_native_module(module, group, input_is_parallel=not style.split_input)
            elif isinstance(style, GradAllReduce):
                sum_grads_over_tp(module, group)
                continue
            elif isinstance(style, KVHeads):
                keep_own_head(module, style.num_heads, group)
                continue
            elif isinstance(style, SharedTailGrad):
                sum_tail_grad_over_tp(module, style.features, group)
                continue
            elif isinstance(style, Experts):
                split_experts(module, group)
                continue
            elif isinstance(style, VocabEmbedding) and type(module).forward is not nn.Embedding.forward:
                shard_embedding_in_place(module, group, multiple)  # its own forward (e.g. scaled) on local ids
                continue
            elif isinstance(style, VocabEmbedding):
                new = VocabParallelEmbedding.from_native_module(module, group, make_vocab_size_divisible_by=multiple)
            elif isinstance(style, VocabHead):
                gather = style.gather_output or not cfg.parallel_output
                padded = padded_size(module.out_features, tp, multiple)
                new = vocab_parallel_lm_head(module, group, gather_output=gather, padded_vocab=padded)
                if not gather:  # the model's own loss must then be the vocab-parallel cross-entropy
                    new.gather_output_in_eval = True
                    start = new.output_start
                    vocab = module.out_features
                    self.model.loss_function = _ParallelCausalLMLoss(parallel_causal_lm_loss, group, start, vocab)
            elif isinstance(style, HeadEmbedding):
                new = HeadParallelEmbedding(module, group)
            else:
                raise TypeError(f"Unknown parallel style {style!r} for {path}.")
            replace_submodule(self.model, path, new)
        for name, p in list(self.model.named_parameters()):  # raw parameters (e.g. sinks, stacked experts)
            style = self._style_of(name)
            if isinstance(style, SplitParam):
                parent, attr = get_submodule_parent(self.model, name)
                spec = TPSpec(style.dim % p.dim(), style.n_fused)
                setattr(parent, attr, shard_parameter(p, spec, dist.get_rank(group), tp))

    def _retie(self, tied: List[List[str]]) -> None:
        """Parameters that were one before replacement (tied embeddings, MLM bias) become one again."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for names in tied:
            held = [n for n in names if n in params]
            if len(held) > 1:  # the sharded one wins (a replaced module made it; the others still hold the old one)
                source = next((params[n] for n in held if get_tp_spec(params[n]) is not None), params[held[0]])
                for name in held:
                    parent, attr = get_submodule_parent(self.model, name)
                    setattr(parent, attr, source)

    def _change_attributes(self) -> None:
        tp, prefix = self.shard_config.tp_size, self.policy.base_prefix
        for path, module in self.model.named_modules():
            if not path.startswith(prefix) or self._replicated_layers(path[len(prefix):]):
                continue
            for pattern, attrs in self.policy.tp_attributes.items():
                if match(pattern, path[len(prefix):]):
                    for attr in attrs:
                        setattr(module, attr, getattr(module, attr) // tp)
            for pattern, values in self.policy.tp_attribute_values.items():
                if match(pattern, path[len(prefix):]):
                    for attr, value in values.items():
                        if hasattr(module, attr):
                            setattr(module, attr, value)

    def _use_tracker_rng(self) -> None:
        """Dropout draws from the tracker: the model's forward under its shared state (not the script's global RNG),
        modules on sharded activations under this rank's private state."""
        tracker = self.shard_config.rng_tracker
        if tracker is None:
            return
        from .layer.dropout import (wrap_model_forward_in_tracker_rng, wrap_module_forward_in_local_rng,
                                    wrap_module_forward_in_shared_rng)

        wrap_model_forward_in_tracker_rng(self.model, tracker)
        if self.shard_config.sp_mode is not None:  # every activation inside a layer is split: per-rank masks
            for layer in self.policy.layer_list():
                wrap_module_forward_in_local_rng(layer, tracker)
            return
        prefix = self.policy.base_prefix
        for path, module in self.model.named_modules():
            rel = path[len(prefix):] if path.startswith(prefix) else None
            if rel is None:
                continue
            if any(match(p, rel) for p in self.policy.local_rng_modules):
                wrap_module_forward_in_local_rng(module, tracker)
            elif any(match(p, rel) for p in self.policy.shared_rng_modules):
                wrap_module_forward_in_shared_rng(module, tracker)


class _ParallelCausalLMLoss:
    """`model.loss_function` for a vocab-parallel LM head: same semantics as transformers' ForCausalLMLoss."""

    def __init__(self, fn, group, vocab_start: int, vocab_size: int) -> None:
        self.fn, self.group, self.vocab_start, self.vocab_size = fn, group, vocab_start, vocab_size

    def __call__(self, logits, labels, vocab_size=None, **kwargs):
        if logits.shape[-1] == self.vocab_size:  # eval mode: the head gathered the full logits
            from transformers.loss.loss_utils import ForCausalLMLoss
            return ForCausalLMLoss(logits, labels, vocab_size=self.vocab_size, **kwargs)
        return self.fn(logits, labels, vocab_size=self.vocab_size, tp_group=self.group,
                       vocab_start=self.vocab_start, **kwargs)


def _nullcontext():
    import contextlib
    return contextlib.nullcontext()


def _native_view(module: nn.Module, parallel_types) -> nn.Module:
    """The module as HF's `_init_weights` knows it: a tensor-parallel layer becomes a shell of its native class
    (nn.Linear / transformers Conv1D / nn.Embedding) sharing its shard's parameters; others are returned as is."""
    column, row, embedding = parallel_types
    if isinstance(module, (column, row)):
        native = nn.Linear
        if module.is_conv1d:
            from transformers.pytorch_utils import Conv1D
            native = Conv1D
        shell = native.__new__(native)
        nn.Module.__init__(shell)
        shell.weight, shell.bias = module.weight, module.bias
        return shell
    if isinstance(module, embedding):
        shell = nn.Embedding.__new__(nn.Embedding)
        nn.Module.__init__(shell)
        shell.weight, shell.padding_idx = module.weight, module.local_padding_idx
        return shell
    return module
