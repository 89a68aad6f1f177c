"""Model preparation, in order, on one screen: what `boost` does to a model and its optimizer.

1. checks that must fail alike on every rank (the optimizer ZeRO can step, a model not boosted before, the same
   model on every rank);
2. the policy (ours, derived from transformers' plans, or the user's) and the unsharded layout for checkpoints;
3. sharding in place (tensor-parallel layers, this rank's pipeline stage), split backward for the V schedules,
   activation checkpointing, the precision, lazy parameters materialized on the device;
4. the boosted module (data-parallel buckets, parameters shared by stages), replicas made identical, guards on
   calls outside the schedule and on optimizers that skip boost;
5. the optimizer pointed at this rank's parameters and wrapped (ZeRO, master weights, loss scaling, clipping).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from pipeline import PipelineStageManager
from pipeline.context import ParallelContext
from pipeline.stage_link import StageLink
from pipeline.styles import ScheduleStyle
from pipeline.trace import ScheduleTracer
from shardformer.layer.dropout import TPRNGTracker
from shardformer.layer.split_weight_grads import prepare_split_backward
from shardformer.multimodal_batch import image_rows
from shardformer.policies import Policy, get_autopolicy
from shardformer.policies.from_transformers import PlanRefused
from shardformer.policies.proven import ProvenPolicy
from shardformer.policies.whole_model import WholeModelPolicy
from shardformer.proof.prove import prove_policy
from shardformer.precision import cast_to_compute_dtype
from shardformer.shard_config import SequenceSplit
from shardformer.sharder import ShardConfig, Sharder, ShardResult
from shardformer.stage.forward import StageForward
from shardformer.stage.pipelined_call import PipelinedCall

from ..core.activation_checkpoint import apply_activation_checkpointing
from ..guards.batch_check import BatchLimits, DirectCallCheck, label_vocab_of, vocab_of
from .config import PrecisionConfig, ShardingConfig
from .speed import use_kernels
from ..guards.failure import FailureGuard
from ..core.lora import LoRAState, adapter_file_keys, materialize_adapters, split_peft_model
from ..core.mixed_precision import DynamicLossScaler
from ..core.optimizer import HybridParallelOptimizer
from ..core.regional_compile import compile_layers
from .optimizer_carry import carry_state, unsharded_state
from ..guards.optimizer_guard import guard_parameters
from ..core.parallel_module import HybridParallelModule, ModelInfo, SharedParam
from ..core.stage_calls import route_direct_calls
from .usage_checks import agree_on_model, refuse_boosted_twice, remember_boosted
from ..core.zero import ZeroOptimizer, check_zero_optimizer

__all__ = ["PrepareOptions", "prepare_model", "shard_config_of"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrepareOptions:
    """The plugin's settings model preparation reads."""
    sharding: ShardingConfig
    precision: PrecisionConfig
    style: ScheduleStyle          # the pipeline schedule's style (its backward may be split)
    check_batches: bool
    device: torch.device


def prepare_model(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], opts: PrepareOptions,
                  ctx: ParallelContext, stage_manager: PipelineStageManager, failure_guard: FailureGuard,
                  tracer: Optional[ScheduleTracer]) -> Tuple[HybridParallelModule, Optional[HybridParallelOptimizer]]:
    """Shard `model` in place for this rank and wrap it (and `optimizer`, built over its parameters); collective."""
    if optimizer is not None and opts.precision.zero_stage > 0:
        check_zero_optimizer(optimizer, opts.precision.zero_stage)
    model, peft_model = split_peft_model(model)  # a LoRA model: shard the transformers model inside it
    refuse_boosted_twice(model)
    agree_on_model(peft_model if peft_model is not None else model)  # the same model on every rank
    lora = None
    if peft_model is not None:
        materialize_adapters(peft_model)  # built on the meta device: peft's own init for the small adapters
        lora = LoRAState(peft_model, adapter_file_keys(peft_model))
    param_names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):  # a tied parameter has several names
        param_names.setdefault(id(p), []).append(name)
    policy = opts.sharding.custom_policy if opts.sharding.custom_policy is not None else _policy_of(model, opts, ctx)
    # the unsharded layout (names, shapes, dtypes), for checkpoints in HF format; what batches the model accepts
    multiple, split = _sequence_split(opts.sharding, ctx)
    info = ModelInfo(policy, {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)},
                     BatchLimits(vocab_of(model), label_vocab_of(model), sequence_multiple=multiple, sequence_split=split,
                                 ragged=image_rows(model.config) if hasattr(model, "config") else None), lora)
    sharded = _shard(model, policy, opts, ctx, stage_manager)
    info = replace(info, expert_params=frozenset(sharded.expert_params), sequence_head=sharded.sequence_head,
                   chunked_loss=sharded.chunked_loss, placement=sharded.placement,
                   compiled_layers=opts.sharding.speed.compile_layers)
    params = dict(model.named_parameters(remove_duplicate=False))
    shared = []
    for names in sharded.shared:  # every rank creates every group, in the same order
        stages = sorted(names)
        group = ctx.group_over(ctx.pp, stages)
        if ctx.pp.rank in names:
            shared.append(SharedParam(params[names[ctx.pp.rank]], group, ctx.pp.rank == stages[0]))
    module = HybridParallelModule(model, sharded.stage_forward, ctx, info, shared, opts.precision.zero_stage,
                                  bucket_bytes=opts.precision.bucket_bytes, failure_guard=failure_guard)
    module.sync_params()
    if ctx.pp.size > 1:  # a stage alone cannot run the model: the schedule calls it, or every rank to evaluate
        # the ranks of a replica's pipeline (and tp groups) agree on a direct call's inputs before it runs
        checks = [DirectCallCheck(info.batch_limits, ctx.dp.rank, group, opts.device)
                  for group in (ctx.pp.active, ctx.tp.active) if opts.check_batches and group is not None]
        route_direct_calls(module, model, stage_manager, *_pipelined_call(model, sharded, stage_manager, opts.device),
                           guard=failure_guard, checks=checks)
    if opts.check_batches and ctx.tp.size > 1 and ctx.pp.size == 1:  # `model(**batch)` agrees over tp first
        module.register_forward_pre_hook(DirectCallCheck(info.batch_limits, ctx.dp.rank, ctx.tp.group, opts.device),
                                         with_kwargs=True)
    guard_parameters(module)  # an optimizer that skips boost is refused at its step
    if optimizer is None:
        return module, None
    _rebind_optimizer(optimizer, param_names, params)
    carried = unsharded_state(optimizer, param_names)  # stepped before boost: carried onto the shards below
    wrapper = ZeroOptimizer if opts.precision.zero_stage > 0 else HybridParallelOptimizer
    scaler = DynamicLossScaler(opts.precision.scaler, opts.device) if opts.precision.precision == "fp16" else None
    boosted = wrapper(optimizer, module, opts.precision.max_norm, tracer=tracer,
                      master_dtype=torch.float32 if opts.precision.precision != "fp32" else None, scaler=scaler,
                      on_nonfinite=opts.precision.on_nonfinite)
    carry_state(boosted, carried, ctx)
    return module, boosted


def shard_config_of(sharding: ShardingConfig, ctx: ParallelContext, stage_manager: PipelineStageManager,
                    rng_tracker: Optional[TPRNGTracker] = None) -> ShardConfig:
    """How the model is sharded (`plugin.shard_config`, ColossalAI's name; at boost with tp's dropout RNG)."""
    return ShardConfig(
        tp=ctx.tp,
        pipeline_stage_manager=stage_manager if ctx.pp.size > 1 else None,
        parallel_output=sharding.parallel_output,
        make_vocab_size_divisible_by=sharding.make_vocab_size_divisible_by, rng_tracker=rng_tracker,
        ep=ctx.ep,
        sequence=None if sharding.sp_mode is None else SequenceSplit(sharding.sp_mode, ctx.seq,
                                                                     own_group=ctx.seq is ctx.sp),
        chunked_loss=sharding.chunked_loss, loss_chunk_size=sharding.loss_chunk_size,
        compile_loss=sharding.speed.compile_layers)


def _shard(model: nn.Module, policy: Policy, opts: PrepareOptions, ctx: ParallelContext,
           stage_manager: PipelineStageManager) -> ShardResult:
    """Step 3: the model becomes this rank's shard, on the device: the Sharder's steps (shardformer/sharder.py),
    then split backward, activation checkpointing, compute dtype, materialization, device."""
    rng_tracker = None
    if ctx.tp.size > 1:
        rng_tracker = TPRNGTracker(opts.device)
        # dropout masks the same across tp, not dp; drawn from the tracker, the script's global RNG is left alone
        rng_tracker.sync(ctx.tp.group, opts.sharding.seed + ctx.dp.rank)
    prove = prove_policy if isinstance(policy, ProvenPolicy) else None  # an inferred plan: proven on a twin first
    use_kernels(model, opts.sharding.speed, opts.device)
    sharder = Sharder(model, policy, shard_config_of(opts.sharding, ctx, stage_manager, rng_tracker), prove)
    if opts.sharding.custom_policy is not None:  # a plan written by hand: an entry matching nothing is a typo
        policy.check_plan()
    sharded = sharder.shard()
    remember_boosted(model)  # sharded in place: boosting this object again is refused
    if opts.style.splits_backward:  # their backward is split into I and W (pipeline/split_backward.py)
        prepare_split_backward(model)
    per_stage = list(sharded.placement.split)
    if ctx.pp.size > 1:  # as ColossalAI's policies do: the layer ranges of this stage's chunks
        stage_manager.stage_indices = stage_manager.get_stage_index(per_stage)
    layout = stage_manager.layout  # checkpointing counts per pipeline rank: a rank's chunks together
    apply_activation_checkpointing(model, list(sharded.plan.layer_list(model)), ctx.pp.rank,
                                   [sum(per_stage[s] for s in layout.stages_of(r)) for r in range(ctx.pp.size)],
                                   opts.sharding.gradient_checkpoint_config, rng_tracker)
    if opts.precision.precision in _DTYPES:
        cast_to_compute_dtype(model, _DTYPES[opts.precision.precision])  # rotary tables stay fp32
    sharder.materialize(opts.device)  # lazy init: a model built on the meta device gets only this rank's shard
    model.to(opts.device)
    if opts.sharding.speed.compile_layers:  # compiled at their first call, with everything above in place
        compile_layers(list(sharded.plan.layer_list(model)))
    return sharded


def _pipelined_call(model: nn.Module, sharded: ShardResult, stage_manager: PipelineStageManager,
                    device: torch.device) -> Tuple[Optional[PipelinedCall], str]:
    """How this stage runs a direct evaluation call as part of one pipelined forward (None, and why not)."""
    stage_forward = sharded.stage_forward
    if not isinstance(stage_forward, StageForward):
        return None, (f"{type(model).__name__} is split by its policy's own stage structure (an encoder-decoder "
                      f"model), which direct calls under pipeline parallelism do not run")
    plan = sharded.plan
    chunked = sharded.chunked_loss
    return PipelinedCall(stage_forward, [plan.base_prefix + path for path in plan.exit], list(plan.heads),
                         StageLink(stage_manager, device), chunked.full_logits if chunked is not None else None), ""


def _policy_of(model: nn.Module, opts: PrepareOptions, ctx: ParallelContext) -> Policy:
    """The model's policy; without any split inside the model (tp = pp = 1, no sp, no ep: ZeRO and dp only), a model
    without one (any nn.Module, as ColossalAI's LowLevelZeroPlugin takes) trains whole (WholeModelPolicy)."""
    try:
        return get_autopolicy(model)
    except PlanRefused:
        if ctx.tp.size == ctx.pp.size == ctx.ep.size == 1 and opts.sharding.sp_mode is None:
            return WholeModelPolicy()
        raise


def _sequence_split(sharding: ShardingConfig, ctx: ParallelContext) -> Tuple[int, str]:
    """What a batch's sequence length must be a multiple of, and the split that asks for it, in the plugin's
    words: the ranks the sequence is split over (ring_attn: two chunks each)."""
    if sharding.sp_mode is None:
        return 1, ""
    ranks, name = ctx.seq.size, f"{ctx.seq.name}_size"
    if sharding.sp_mode == "ring_attn":
        return 2 * ranks, f"{name}={ranks} ranks in 2 chunks each (ring_attn)"
    return ranks, f"{name}={ranks} ranks ({sharding.sp_mode})"


def _rebind_optimizer(optimizer: torch.optim.Optimizer, names: Dict[int, list], params: Dict[str, nn.Parameter]) -> None:
    """Point the optimizer at this stage's (possibly re-created, sharded) parameters, by name; drop the rest."""
    for group in optimizer.param_groups:
        rebound, seen = [], set()
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("The optimizer holds a parameter that is not in the model: build the optimizer "
                                 "from model.parameters() before boosting.")
            new = next((params[n] for n in names[id(p)] if n in params), None)
            if new is not None and id(new) not in seen:
                rebound.append(new)
                seen.add(id(new))
        group["params"] = rebound
