"""Sharder: applies a policy to a model in place — release what this pipeline stage does not hold, replace modules
with tensor-parallel ones, re-tie shared weights — and returns what the runtime needs to drive the stage."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch.distributed as dist
from torch import nn

from .apply_styles import TPContext, apply_styles
from .expert_sharding import check_expert_parallel, refuse_sequence_parallelism, shard_experts
from .layer.dropout import (wrap_model_forward_in_tracker_rng, wrap_module_forward_in_local_rng,
                            wrap_module_forward_in_shared_rng)
from .layer.spec import get_tp_spec
from .lora_sharding import check_lora_layers
from .materialize import materialize
from .paths import match
from .policies.base import Policy
from .regions import enter_tp_regions_once
from .release import release_unheld
from .sequence_parallel import (SEQUENCE_DIM, apply_sequence_parallelism, check_sequence_parallelism, inside_layers,
                                sequence_span)
from .chunked_loss import ChunkedLoss, use_chunked_loss
from .sequence_loss import HeadOnShard
from .shard_config import ShardConfig
from .stage import StageForward, get_submodule_parent
from .styles import ParallelStyle

__all__ = ["ShardConfig", "Sharder"]


class Sharder:
    """Applies `policy` to `model` in place, as `shard_config` says (see the module docstring)."""

    def __init__(self, model: nn.Module, policy: Policy, shard_config: ShardConfig) -> None:
        self.model = model
        self.policy = policy
        self.shard_config = shard_config
        self.stage_forward: Optional[StageForward] = None
        self.expert_params: List[str] = []  # parameters holding this rank's experts only (expert parallel)
        self.sequence_head: Optional[HeadOnShard] = None  # the sequence kept split through the head (sequence_loss)
        self.chunked_loss: Optional[ChunkedLoss] = None  # the causal-LM loss computed in chunks (chunked_loss.py)
        policy.set_model(model)
        policy.set_shard_config(shard_config)
        policy.set_pipeline_stage_manager(shard_config.pipeline_stage_manager)

    def shard(self) -> List[Dict[int, str]]:
        """Shard in place; returns the shared parameters as [{stage: parameter name on that stage}]."""
        self.policy.check_paths()
        self.policy.check_tp(self.model.config, self.shard_config.tp_size)
        mode = self.shard_config.sp_mode
        if mode is not None:
            refuse_sequence_parallelism(self.model, self._plan_style, mode)
            check_sequence_parallelism(self.policy, mode, self.model.config, self.shard_config.tp_size,
                                       self._sp_size())
        span = sequence_span(self.policy) if mode is not None else None  # before this stage keeps its own modules
        if self.shard_config.tp_size > 1:  # on the unsharded model, every rank alike, before any collective
            check_lora_layers(self.model, self._style_of)
        if self.shard_config.ep_size > 1:
            check_expert_parallel(self.model, self._plan_style, self.shard_config.ep_size)
        tied = self._tied_names()
        shared = self.policy.shared_param_names() if self.shard_config.pipeline_stage_manager else []
        if self.shard_config.pipeline_stage_manager is not None:
            self._release_unheld_layers()
        if self.shard_config.tp_size > 1:
            cfg = self.shard_config
            apply_styles(TPContext(self.model, cfg.tensor_parallel_process_group, cfg.tp_size,
                                   cfg.make_vocab_size_divisible_by, cfg.parallel_output, cfg.rng_tracker),
                         self._style_of)
            self._retie(tied)
            enter_tp_regions_once(self.model, self.policy, self.shard_config.tensor_parallel_process_group,
                                  SEQUENCE_DIM if mode == "split_gather" else None)
            self._change_attributes()
            self._use_tracker_rng()
        if mode is not None:
            self.sequence_head = apply_sequence_parallelism(
                self.model, self.policy, span, mode, self.shard_config.sp_group,
                own_group=self.shard_config.sequence_parallel_process_group is not None,
                parallel_output=self.shard_config.parallel_output)
        if self.shard_config.ep_size > 1:  # after the tp split: its hooks run inside the exchange
            self.expert_params = shard_experts(self.model, self._plan_style,
                                               self.shard_config.expert_parallel_process_group)
        if self.shard_config.chunked_loss:  # last: its hooks run after those of tp and sequence parallelism
            self.chunked_loss = use_chunked_loss(self.model, self.shard_config.loss_chunk_size, self.sequence_head)
        return shared

    def materialize(self, device, init: bool = True) -> int:
        """Allocate the meta parameters and buffers this rank still holds (after sharding) on `device`, initialized
        with `init` (see materialize.py); the number of bytes allocated."""
        sm = self.shard_config.pipeline_stage_manager
        return materialize(self.model, device, self.shard_config.tensor_parallel_process_group,
                           sm.stage if sm is not None else 0, init)

    # -- pipeline ----------------------------------------------------------------------------------------
    def _release_unheld_layers(self) -> None:
        """Prune the model to this rank's stage: by the policy's own hook (encoder-decoder), else release.py."""
        hook = self.policy.release_unheld_layers
        if hook is not None:
            self.stage_forward = hook()
        else:
            self.stage_forward = release_unheld(self.model, self.policy, self.shard_config.pipeline_stage_manager)

    # -- tensor parallel ---------------------------------------------------------------------------------
    def _tied_names(self) -> List[List[str]]:
        by_id: Dict[int, List[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        return [names for names in by_id.values() if len(names) > 1]

    def _sp_size(self) -> int:
        """Ranks of the sequence-parallel group of its own (1: none, the sequence is split over tp)."""
        group = self.shard_config.sequence_parallel_process_group
        return 1 if group is None else dist.get_world_size(group)

    def _replicated_layers(self, rel: str) -> bool:
        """all_to_all sequence parallelism over the tp group keeps the layers' weights whole: no tp style or
        attribute inside them (over a group of its own, tp splits them as usual)."""
        return (self.shard_config.sp_mode == "all_to_all" and self.shard_config.sequence_parallel_process_group is None
                and inside_layers(self.policy, rel))

    def _plan_style(self, path: str) -> Optional[ParallelStyle]:
        """The plan's style of a module, whatever sequence parallelism does to it."""
        return self._style_of(path, honour_sequence_parallelism=False)

    def _style_of(self, path: str, honour_sequence_parallelism: bool = True) -> Optional[ParallelStyle]:
        prefix = self.policy.base_prefix
        if path.startswith(prefix):
            if honour_sequence_parallelism and self._replicated_layers(path[len(prefix):]):
                return None
            for pattern, style in self.policy.tp_plan.items():
                if match(pattern, path[len(prefix):]):
                    return style
        for pattern, style in self.policy.head_tp_plan.items():
            if match(pattern, path):
                return style
        return None

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
