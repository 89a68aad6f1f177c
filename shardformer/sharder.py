"""Sharding as data. First the policy's step (`prepare_plan`: its checks, the proof of a plan that must be proven, then
its frozen values: the Plan and the StagePlacement), then an ordered tuple of module-level transforms (TRANSFORMS:
check the layout, release what this pipeline stage does not hold, tensor parallel, expert parallel, sequence
parallel, chunked loss), each `(model, plan, ctx, done) -> ShardResult`, torchtitan's `parallelize_*` style: they
read the plan, never the policy; `ctx` (ShardContext) is passed down unchanged, `done` is what the steps before it
produced, and each returns it with its own fields filled. `shard` folds them in order into one typed ShardResult.
What follows sharding (split backward, activation checkpointing, compute dtype, materialization) is booster_plugin's
prepare_model, in its own ordered steps."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple

from torch import nn

from .chunked_loss import ChunkedLoss, use_chunked_loss
from .expert.sharding import check_expert_parallel, refuse_sequence_parallelism, shard_experts
from .layer.dropout import (wrap_model_forward_in_tracker_rng, wrap_module_forward_in_local_rng,
                            wrap_module_forward_in_shared_rng)
from .layer.spec import get_tp_spec
from .materialize import materialize
from .paths import match
from .policies.base import Policy
from .policies.plan import Plan
from .sequence.loss import HeadOnShard
from .sequence.parallel import (SEQUENCE_DIM, SequenceSpan, apply_sequence_parallelism, check_sequence_plan,
                                sequence_span)
from .shard_config import ShardConfig
from .stage.forward import StageForward, get_submodule_parent
from .stage.placement import StagePlacement
from .stage.release import release_unheld
from .tensor.apply_styles import TPContext, apply_styles
from .tensor.lora_sharding import check_lora_layers
from .tensor.regions import enter_tp_regions_once
from .tensor.styles import ParallelStyle

__all__ = ["ShardConfig", "ShardContext", "ShardResult", "Sharder", "TRANSFORMS", "bind", "prepare_plan", "shard"]


@dataclass(frozen=True)
class ShardContext:
    """What every transform reads besides the model and its plan, passed down unchanged."""
    config: ShardConfig
    prove: Optional[Callable[[Policy], None]] = None  # run on the bound policy before anything changes


@dataclass(frozen=True)
class ShardResult:
    """What sharding produced, for the runtime: each field filled by one step (`prepare_plan`, TRANSFORMS)."""
    plan: Optional[Plan] = None                                 # the policy's plan, a frozen value
    placement: Optional[StagePlacement] = None                  # the unsharded model's split over the pipeline
    shared: List[Dict[int, str]] = field(default_factory=list)  # [{stage: name of a parameter shared by stages}]
    stage_forward: Optional[StageForward] = None                # runs this rank's chunks (None without pp)
    expert_params: List[str] = field(default_factory=list)      # parameters holding this rank's experts only
    sequence_head: Optional[HeadOnShard] = None                 # the sequence kept split through the head
    chunked_loss: Optional[ChunkedLoss] = None                  # the causal-LM loss in chunks (chunked_loss.py)
    span: Optional[SequenceSpan] = None                         # (read before the stage releases its modules)
    tied: List[List[str]] = field(default_factory=list)         # names of parameters that were one before tp


Transform = Callable[[nn.Module, Plan, ShardContext, ShardResult], ShardResult]


def bind(model: nn.Module, policy: Policy, cfg: ShardConfig) -> None:
    """ColossalAI's policy setters, the compatibility surface user-written policies rely on: the policy reads the
    (unsharded) model and the stage layout through them."""
    policy.set_model(model)
    policy.set_shard_config(cfg)
    policy.set_pipeline_stage_manager(cfg.pipeline_stage_manager)


def shard(model: nn.Module, policy: Policy, ctx: ShardContext) -> ShardResult:
    """Shard `model` in place by the bound `policy`: its plan and placement (`prepare_plan`), then the transforms of
    TRANSFORMS, in that order, which read those values and never the policy."""
    done = prepare_plan(model, policy, ctx)
    for transform in TRANSFORMS:
        done = transform(model, done.plan, ctx, done)
    return done


def prepare_plan(model: nn.Module, policy: Policy, ctx: ShardContext) -> ShardResult:
    """On the unsharded model, every rank alike, before any collective: the policy fits the model and the layout
    (its checks), a plan that must be proven is proven (`ctx.prove`), then its frozen values: the plan and the
    pipeline placement."""
    policy.check_paths()
    policy.check_tp(getattr(model, "config", None), ctx.config.tp_size)  # (any module: tp=1)
    if ctx.prove is not None:
        ctx.prove(policy)
    return ShardResult(plan=policy.plan(ctx.config.tp_size), placement=policy.stage_placement())


# -- the transforms --------------------------------------------------------------------------------------------
def check_layout(model: nn.Module, plan: Plan, ctx: ShardContext, done: ShardResult) -> ShardResult:
    """On the unsharded model: the plan fits sequence, tensor (LoRA layers) and expert parallelism; reads what later
    transforms need from the unsharded model (the sequence's span, tied parameters)."""
    cfg, span = ctx.config, None
    if cfg.sp_mode is not None:
        refuse_sequence_parallelism(model, plan.style, cfg.sp_mode)
        check_sequence_plan(model, plan, cfg.sp_mode, model.config, cfg.tp_size, _sp_size(cfg))
        span = sequence_span(model, plan)
    if cfg.tp_size > 1:
        check_lora_layers(model, _style_of(plan, cfg))
    if cfg.ep_size > 1:
        check_expert_parallel(model, plan.style, cfg.ep_size)
    return replace(done, span=span, tied=_tied_names(model))


def release_this_stage(model: nn.Module, plan: Plan, ctx: ShardContext, done: ShardResult) -> ShardResult:
    """Pipeline: keep this rank's stage only, by the policy's own hook (encoder-decoder) or stage/release.py."""
    sm = ctx.config.pipeline_stage_manager
    if sm is None:
        return done
    hook = plan.release
    stage = hook() if hook is not None else release_unheld(model, plan, sm, done.placement.split)
    return replace(done, shared=done.placement.shared_names(), stage_forward=stage)


def tensor_parallel(model: nn.Module, plan: Plan, ctx: ShardContext, done: ShardResult) -> ShardResult:
    """Replace the planned modules with tensor-parallel ones; re-tie, enter regions once, divide attributes,
    draw dropout from the tracker."""
    cfg = ctx.config
    if cfg.tp_size == 1:
        return done
    apply_styles(TPContext(model, cfg.tp, cfg.make_vocab_size_divisible_by, cfg.parallel_output, cfg.rng_tracker),
                 _style_of(plan, cfg))
    _retie(model, done.tied)
    enter_tp_regions_once(model, plan, cfg.tp, SEQUENCE_DIM if cfg.sp_mode == "split_gather" else None)
    _change_attributes(model, plan, cfg)
    _use_tracker_rng(model, plan, cfg)
    return done


def expert_parallel(model: nn.Module, plan: Plan, ctx: ShardContext, done: ShardResult) -> ShardResult:
    """After the tp split (its hooks run inside the exchange), before sequence parallelism's gradient sums
    (which must see the kept experts only)."""
    if ctx.config.ep_size == 1:
        return done
    return replace(done, expert_params=shard_experts(model, plan.style, ctx.config.ep))


def sequence_parallel(model: nn.Module, plan: Plan, ctx: ShardContext, done: ShardResult) -> ShardResult:
    cfg = ctx.config
    seq = cfg.sequence
    if seq is None:
        return done
    head = apply_sequence_parallelism(model, plan, done.span, seq.mode, seq.axis, own_group=seq.own_group,
                                      parallel_output=cfg.parallel_output)
    return replace(done, sequence_head=head)


def chunked_loss(model: nn.Module, plan: Plan, ctx: ShardContext, done: ShardResult) -> ShardResult:
    """Last: its hooks run after those of tensor and sequence parallelism."""
    cfg = ctx.config
    if not cfg.chunked_loss:
        return done
    return replace(done, chunked_loss=use_chunked_loss(model, cfg.loss_chunk_size, done.sequence_head,
                                                               cfg.compile_loss))


TRANSFORMS: Tuple[Transform, ...] = (check_layout, release_this_stage, tensor_parallel, expert_parallel,
                                     sequence_parallel, chunked_loss)


class Sharder:
    """ColossalAI's name for the runner: binds `policy` to `model` and `shard_config`, shards by TRANSFORMS."""

    def __init__(self, model: nn.Module, policy: Policy, shard_config: ShardConfig,
                 prove: Optional[Callable[[Policy], None]] = None) -> None:
        """`prove`: run on the bound policy after the checks, before anything changes (prove.prove_policy for a
        ProvenPolicy; it raises PlanRefused on every rank alike)."""
        self.model, self.policy, self.ctx = model, policy, ShardContext(shard_config, prove)
        bind(model, policy, shard_config)

    @property
    def shard_config(self) -> ShardConfig:
        return self.ctx.config

    def shard(self) -> ShardResult:
        return shard(self.model, self.policy, self.ctx)

    def materialize(self, device, init: bool = True) -> int:
        """Allocate the meta parameters and buffers this rank still holds (after sharding) on `device`, initialized
        with `init` (see materialize.py); the number of bytes allocated."""
        sm = self.shard_config.pipeline_stage_manager
        return materialize(self.model, device, self.shard_config.tp, sm.stage if sm is not None else 0, init)


# -- what the transforms share ------------------------------------------------------------------------------------
def _tied_names(model: nn.Module) -> List[List[str]]:
    by_id: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _sp_size(cfg: ShardConfig) -> int:
    """Ranks of the sequence-parallel group of its own (1: none, the sequence is split over tp)."""
    seq = cfg.sequence
    return seq.size if seq is not None and seq.own_group else 1


def _replicated_layers(plan: Plan, cfg: ShardConfig, rel: str) -> bool:
    """all_to_all sequence parallelism over the tp group keeps the layers' weights whole: no tp style or
    attribute inside them (over a group of its own, tp splits them as usual)."""
    seq = cfg.sequence
    return seq is not None and seq.mode == "all_to_all" and not seq.own_group and plan.inside_layers(rel)


StyleOf = Callable[[str], Optional[ParallelStyle]]


def _style_of(plan: Plan, cfg: ShardConfig) -> StyleOf:
    """The style a module gets (none inside layers that sequence parallelism keeps whole)."""
    return lambda path: plan.style(path, skip=lambda rel: _replicated_layers(plan, cfg, rel))


def _retie(model: nn.Module, tied: List[List[str]]) -> None:
    """Parameters that were one before replacement (tied embeddings, MLM bias) become one again."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for names in tied:
        held = [n for n in names if n in params]
        if len(held) > 1:  # the sharded one wins (a replaced module made it; the others still hold the old one)
            source = next((params[n] for n in held if get_tp_spec(params[n]) is not None), params[held[0]])
            for name in held:
                parent, attr = get_submodule_parent(model, name)
                setattr(parent, attr, source)


def _change_attributes(model: nn.Module, plan: Plan, cfg: ShardConfig) -> None:
    tp, prefix = cfg.tp_size, plan.base_prefix
    for path, module in model.named_modules():
        if not path.startswith(prefix) or _replicated_layers(plan, cfg, path[len(prefix):]):
            continue
        for pattern, attrs in plan.tp_attributes.items():
            if match(pattern, path[len(prefix):]):
                for attr in attrs:
                    setattr(module, attr, getattr(module, attr) // tp)
        for pattern, values in plan.tp_attribute_values.items():
            if match(pattern, path[len(prefix):]):
                for attr, value in values.items():
                    if hasattr(module, attr):
                        setattr(module, attr, value)


def _use_tracker_rng(model: nn.Module, plan: Plan, cfg: ShardConfig) -> None:
    """Dropout draws from the tracker: the model's forward under its shared state (not the script's global RNG),
    modules on sharded activations under this rank's private state."""
    tracker = cfg.rng_tracker
    if tracker is None:
        return
    wrap_model_forward_in_tracker_rng(model, tracker)
    if cfg.sp_mode is not None:  # every activation inside a layer is split: per-rank masks
        for layer in plan.layer_list(model):
            wrap_module_forward_in_local_rng(layer, tracker)
        return
    prefix = plan.base_prefix
    for path, module in model.named_modules():
        rel = path[len(prefix):] if path.startswith(prefix) else None
        if rel is None:
            continue
        if any(match(p, rel) for p in plan.local_rng_modules):
            wrap_module_forward_in_local_rng(module, tracker)
        elif any(match(p, rel) for p in plan.shared_rng_modules):
            wrap_module_forward_in_shared_rng(module, tracker)
