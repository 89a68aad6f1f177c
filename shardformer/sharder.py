"""Sharder: applies a policy to a model in place as an ordered list of steps (Sharder.STEPS: check and prove, release
what this pipeline stage does not hold, tensor parallel, expert parallel, sequence parallel) and returns what the
runtime needs to drive the stage (ShardResult). What follows sharding (split backward, activation checkpointing,
compute dtype, materialization) is booster_plugin's prepare_model, in its own ordered steps."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from torch import nn

from .expert.sharding import check_expert_parallel, refuse_sequence_parallelism, shard_experts
from .layer.dropout import (wrap_model_forward_in_tracker_rng, wrap_module_forward_in_local_rng,
                            wrap_module_forward_in_shared_rng)
from .layer.spec import get_tp_spec
from .materialize import materialize
from .paths import match
from .policies.base import Policy
from .chunked_loss import ChunkedLoss, use_chunked_loss
from .sequence.loss import HeadOnShard
from .sequence.parallel import (SEQUENCE_DIM, SequenceSpan, apply_sequence_parallelism, check_sequence_parallelism,
                                inside_layers, sequence_span)
from .shard_config import ShardConfig
from .stage.forward import StageForward, get_submodule_parent
from .stage.release import release_unheld
from .tensor.apply_styles import TPContext, apply_styles
from .tensor.lora_sharding import check_lora_layers
from .tensor.regions import enter_tp_regions_once
from .tensor.styles import ParallelStyle

__all__ = ["ShardConfig", "ShardResult", "Sharder"]


@dataclass
class ShardResult:
    """What sharding produced, for the runtime: filled by the steps in order (Sharder.STEPS)."""
    shared: List[Dict[int, str]] = field(default_factory=list)  # [{stage: name of a parameter shared by stages}]
    stage_forward: Optional[StageForward] = None                # runs this rank's chunks (None without pp)
    expert_params: List[str] = field(default_factory=list)      # parameters holding this rank's experts only
    sequence_head: Optional[HeadOnShard] = None                 # the sequence kept split through the head
    chunked_loss: Optional[ChunkedLoss] = None                  # the causal-LM loss in chunks (chunked_loss.py)
    span: Optional[SequenceSpan] = None                         # (read before the stage releases its modules)
    tied: List[List[str]] = field(default_factory=list)         # names of parameters that were one before tp


class Sharder:
    """Applies `policy` to `model` in place, as `shard_config` says: the steps of STEPS, in that order."""

    def __init__(self, model: nn.Module, policy: Policy, shard_config: ShardConfig,
                 prove: Optional[Callable[[Policy], None]] = None) -> None:
        """`prove`: run on the bound policy after the checks, before anything changes (prove.prove_policy for a
        ProvenPolicy; it raises PlanRefused on every rank alike)."""
        self.model = model
        self.prove = prove
        self.policy = policy
        self.shard_config = shard_config
        policy.set_model(model)
        policy.set_shard_config(shard_config)
        policy.set_pipeline_stage_manager(shard_config.pipeline_stage_manager)

    def shard(self) -> ShardResult:
        """Shard in place, step by step (STEPS); what the runtime needs."""
        result = ShardResult()
        for step in self.STEPS:
            step(self, result)
        return result

    # -- the steps -------------------------------------------------------------------------------------
    def _check(self, result: ShardResult) -> None:
        """On the unsharded model, every rank alike, before any collective: the plan fits the model and the layout;
        a plan that must be proven is proven."""
        self.policy.check_paths()
        self.policy.check_tp(getattr(self.model, "config", None), self.shard_config.tp_size)  # (any module: tp=1)
        if self.prove is not None:
            self.prove(self.policy)
        mode = self.shard_config.sp_mode
        if mode is not None:
            refuse_sequence_parallelism(self.model, self._plan_style, mode)
            check_sequence_parallelism(self.policy, mode, self.model.config, self.shard_config.tp_size,
                                       self._sp_size())
            result.span = sequence_span(self.policy)
        if self.shard_config.tp_size > 1:
            check_lora_layers(self.model, self._style_of)
        if self.shard_config.ep_size > 1:
            check_expert_parallel(self.model, self._plan_style, self.shard_config.ep_size)
        result.tied = self._tied_names()

    def _release_this_stage(self, result: ShardResult) -> None:
        """Pipeline: keep this rank's stage only, by the policy's own hook (encoder-decoder) or
        stage/release.py."""
        sm = self.shard_config.pipeline_stage_manager
        if sm is None:
            return
        result.shared = self.policy.shared_param_names()
        hook = self.policy.release_unheld_layers
        result.stage_forward = hook() if hook is not None else release_unheld(self.model, self.policy, sm)

    def _tensor_parallel(self, result: ShardResult) -> None:
        """Replace the planned modules with tensor-parallel ones; re-tie, enter regions once, divide attributes,
        draw dropout from the tracker."""
        cfg = self.shard_config
        if cfg.tp_size == 1:
            return
        apply_styles(TPContext(self.model, cfg.tp, cfg.make_vocab_size_divisible_by, cfg.parallel_output,
                               cfg.rng_tracker), self._style_of)
        self._retie(result.tied)
        enter_tp_regions_once(self.model, self.policy, cfg.tp,
                              SEQUENCE_DIM if cfg.sp_mode == "split_gather" else None)
        self._change_attributes()
        self._use_tracker_rng()

    def _expert_parallel(self, result: ShardResult) -> None:
        """After the tp split (its hooks run inside the exchange), before sequence parallelism's gradient sums
        (which must see the kept experts only)."""
        if self.shard_config.ep_size > 1:
            result.expert_params = shard_experts(self.model, self._plan_style,
                                                 self.shard_config.ep)

    def _sequence_parallel(self, result: ShardResult) -> None:
        seq = self.shard_config.sequence
        if seq is not None:
            result.sequence_head = apply_sequence_parallelism(
                self.model, self.policy, result.span, seq.mode, seq.axis, own_group=seq.own_group,
                parallel_output=self.shard_config.parallel_output)

    def _chunked_loss(self, result: ShardResult) -> None:
        """Last: its hooks run after those of tensor and sequence parallelism."""
        if self.shard_config.chunked_loss:
            result.chunked_loss = use_chunked_loss(self.model, self.shard_config.loss_chunk_size, result.sequence_head)

    STEPS = (_check, _release_this_stage, _tensor_parallel, _expert_parallel, _sequence_parallel, _chunked_loss)

    def materialize(self, device, init: bool = True) -> int:
        """Allocate the meta parameters and buffers this rank still holds (after sharding) on `device`, initialized
        with `init` (see materialize.py); the number of bytes allocated."""
        sm = self.shard_config.pipeline_stage_manager
        return materialize(self.model, device, self.shard_config.tp,
                           sm.stage if sm is not None else 0, init)

    # -- tensor parallel ---------------------------------------------------------------------------------
    def _tied_names(self) -> List[List[str]]:
        by_id: Dict[int, List[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        return [names for names in by_id.values() if len(names) > 1]

    def _sp_size(self) -> int:
        """Ranks of the sequence-parallel group of its own (1: none, the sequence is split over tp)."""
        seq = self.shard_config.sequence
        return seq.size if seq is not None and seq.own_group else 1

    def _replicated_layers(self, rel: str) -> bool:
        """all_to_all sequence parallelism over the tp group keeps the layers' weights whole: no tp style or
        attribute inside them (over a group of its own, tp splits them as usual)."""
        seq = self.shard_config.sequence
        return seq is not None and seq.mode == "all_to_all" and not seq.own_group and inside_layers(self.policy, rel)

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
