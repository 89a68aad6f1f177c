"""HybridParallelPlugin: dp × pp × tp over the world, with ColossalAI's argument names."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from pipeline.trace import ScheduleTracer
from pipeline import PipelineP2PCommunication, PipelineSchedule, PipelineStageManager, ProcessGroupMesh
from pipeline.schedule import split_batch
from pipeline.schedules import V_STYLES, layout_for, make_schedule, min_microbatches
from shardformer.parallelformers import as_policy
from shardformer.policies import Policy, get_autopolicy
from shardformer.sequence_parallel import SEQUENCE_PARALLEL_MODES, resolve_mode
from shardformer.layer.deferred import prepare_split_backward
from shardformer.sharder import ShardConfig, Sharder

from .activation_checkpoint import GradientCheckpointConfig, apply_activation_checkpointing
from .batch_check import BatchLimits, DirectCallCheck, agree_on_batch, batch_agreed, label_vocab_of, vocab_of
from .colossal_args import check_unacted_args
from .lora import LoRAState, adapter_file_keys, materialize_adapters, split_peft_model
from .failure import FailureGuard
from .launch import (ARRIVAL_TIMEOUT_S, DEFAULT_TIMEOUT_S, agree_on_layout, alias, check_int, default_device,
                     ensure_distributed)
from .microbatches import default_num_microbatches, token_weighted_scales, without_empty_microbatches
from .mixed_precision import DynamicLossScaler, LossScalerConfig
from .optimizer import HybridParallelOptimizer
from .optimizer_guard import guard_parameters
from .parallel_module import HybridParallelModule
from .stage_calls import refuse_calls_outside_schedule
from .usage_checks import (check_batch_content, check_criterion, check_step_arguments, refuse_boosted_twice,
                           remember_boosted)
from .v_schedule import fingerprint, schedule_from_nodes
from .zero import ZeroOptimizer, check_zero_optimizer

DP_AXIS, PP_AXIS, TP_AXIS = 0, 1, 2
_SUPPORTED_PRECISIONS = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class HybridParallelPlugin:
    """Tensor parallel inside each stage, pipeline across stages, data parallel over the rest of the world.

    Takes every argument of ColossalAI 0.5's HybridParallelPlugin by name (those it does not act on are listed in
    `colossal_args.py`: a speed-only option is accepted with a warning, a result-changing one is refused).

    Args:
        tp_size, pp_size: tensor- and pipeline-parallel sizes (`tp`, `pp` are aliases); dp = world / (tp * pp).
        num_microbatches, microbatch_size: at most one; with pp_size > 1 and neither, each step picks the largest
            divisor of its batch size in [pp_size, 4 * pp_size] as the number of microbatches.
        pp_style, num_model_chunks: "1f1b" (1 chunk per rank), "interleaved" (v >= 2 chunks in a loop), "zbv"
            (ColossalAI's zero-bubble V: 2 chunks, backward split into input and weight gradients) or "dualpipev"
            (the same V with full backwards in the steady state: faster, one more chunk activation, m >= 2p).
        precision: "fp32" (default; ColossalAI's default is "fp16") or "bf16" (fp32 master weights).
        max_norm: clip the global gradient norm (0: off).
        custom_policy: a `shardformer.Policy` for a model without a built-in one, or Parallelformers-style block
            policies (a class, an instance or a list; `shardformer.parallelformers`).
        num_layers_per_stage: the layer split, e.g. [3, 5]; default: even, remainder to the middle stages.
        parallel_output: keep the LM head's logits vocab-sharded in training (vocab-parallel loss).
        make_vocab_size_divisible_by: vocabulary padding multiple per tp rank.
        enable_sequence_parallelism, sequence_parallelism_mode: split the sequence over the tp group between the
            first and last decoder layer (needs tp_size > 1 and sequence lengths divisible by it; training mode only):
            "split_gather" (default; Megatron-LM: weights tensor-split, all-gather into and reduce-scatter out of the
            attention/MLP) or "all_to_all" (DeepSpeed-Ulysses: decoder-layer weights replicated over the tp group,
            heads exchanged for sequence around attention). `sp_size` (ColossalAI's separate group): unset or 1.
        enable_metadata_cache: send P2P shapes only when they change.
        ddp_bucket_cap_mb: size of the data-parallel gradient buckets.
        p2p_transport: "p2p" (batched isend/irecv) or "broadcast".
        scheduler_nodes: ColossalAI's zbv order (`PipelineGraph(...).get_v_schedule()`, booster_plugin/v_schedule.py),
            run as given; default: ours.
        pp_schedule_costs: "unit" (default: the V styles' order generated for equal F, I, W times; bitwise
            reproducible) or "measured" (zbv and dualpipev re-plan their order for the compute times of their first
            training step with a number of microbatches, measured on every rank: pipeline/refine.py; faster, but the
            order, hence the rounding of gradient sums and the dropout draws, then depends on timings).
        seed: with tp_size > 1, the seed of the dropout RNG the model's forward runs under (identical masks across tp
            for replicated activations; `seed + dp_rank` per replica). The script's global RNG is neither reseeded
            nor advanced by it. With tp_size == 1 dropout draws from the global RNG, as in one process.
        trace: record a timeline of the schedule (also HP_TRACE=1).
        loss_weight_fn: `micro_batch -> number of loss items`, for a token-weighted loss.
        timeout: seconds a collective may wait before every rank fails (the process groups' timeout; default 600,
            `launch.DEFAULT_TIMEOUT_S`; a world group the script initialized itself keeps its own unless given).
        on_nonfinite: inf/nan gradients at `optimizer.step()` (detected by one all-reduced flag): "skip" the step
            on every rank with a warning naming the step and stages (default), "raise" FloatingPointError on every
            rank, or "ignore" (step anyway, as one process would). fp16: an overflow above `min_scale` is the loss
            scaler's (skipped, the scale backs off); one at `min_scale` is non-finite: "skip" warns and raises after
            MAX_SKIPS_AT_MIN_SCALE such steps in a row, "raise" raises at once, "ignore" skips silently.
        check_batches: agree on each step's batch over the world (one small all-gather), so a bad batch on any rank
            (shapes or contents differing within a replica, ids or labels outside the vocabulary, an attention mask
            that does not match the ids, a batch that does not split) raises the same error on every rank instead of
            hanging the others or training on different data; with tp_size > 1 and pp_size == 1, a call of the model
            the script makes itself agrees the same way over the tp group.
    """

    def __init__(self, tp_size: int = 1, pp_size: int = 1, num_microbatches: Optional[int] = None,
                 microbatch_size: Optional[int] = None, precision: str = "fp32", zero_stage: int = 0,
                 max_norm: float = 0.0, custom_policy: Optional[Policy] = None,
                 num_layers_per_stage: Optional[Sequence[int]] = None, pp_style: str = "1f1b",
                 num_model_chunks: int = 1, enable_sequence_parallelism: bool = False,
                 sequence_parallelism_mode: Optional[str] = None, sp_size: Optional[int] = None,
                 parallel_output: bool = True, make_vocab_size_divisible_by: int = 64,
                 enable_metadata_cache: bool = True, ddp_bucket_cap_mb: float = 25, p2p_transport: str = "p2p",
                 pp_schedule_costs: str = "unit", scheduler_nodes: Optional[Sequence[Sequence[Any]]] = None,
                 seed: int = 1024, trace: Optional[bool] = None,
                 loss_weight_fn: Optional[Callable[[Dict[str, Any]], Any]] = None, timeout: Optional[float] = None,
                 check_batches: bool = True, on_nonfinite: str = "skip",
                 initial_scale: float = 2 ** 16, growth_factor: float = 2, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2, min_scale: float = 1, max_scale: float = 2 ** 32,
                 gradient_checkpoint_config: Optional[GradientCheckpointConfig] = None,
                 tp: Optional[int] = None, pp: Optional[int] = None, **colossalai_kwargs: Any) -> None:
        # every check before the first collective, so that bad input fails the same way on every rank
        tp_size, pp_size = alias("tp", tp, "tp_size", tp_size), alias("pp", pp, "pp_size", pp_size)
        check_unacted_args(colossalai_kwargs, rank=int(os.environ.get("RANK", "0")) if not dist.is_initialized()
                           else None)
        check_int("tp_size", tp_size, 1)
        check_int("pp_size", pp_size, 1)
        if num_microbatches is not None and microbatch_size is not None:
            raise ValueError(f"Give at most one of num_microbatches={num_microbatches} and "
                             f"microbatch_size={microbatch_size}.")
        if num_microbatches is not None:
            check_int("num_microbatches", num_microbatches, 1)
        if microbatch_size is not None:
            check_int("microbatch_size", microbatch_size, 1)
        if precision not in _SUPPORTED_PRECISIONS:
            raise ValueError(f"precision={precision!r} is not supported; use one of {_SUPPORTED_PRECISIONS}.")
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage={zero_stage!r} is not supported; use 0, 1 or 2.")
        self.scaler_config = LossScalerConfig(initial_scale, growth_factor, backoff_factor, growth_interval,
                                              hysteresis, min_scale, max_scale)
        if precision == "fp16":
            self.scaler_config.check()
        if gradient_checkpoint_config is not None:
            gradient_checkpoint_config.check(pp_size)
        self.gradient_checkpoint_config = gradient_checkpoint_config
        if isinstance(num_layers_per_stage, str) and num_layers_per_stage != "auto":
            raise ValueError(f"num_layers_per_stage must be a list, None or 'auto', got {num_layers_per_stage!r}.")
        layout = layout_for(pp_style, pp_size, num_model_chunks)  # "1f1b", "interleaved", "zbv" or "dualpipev"
        if pp_style != "1f1b" and (pp_size == 1 or p2p_transport != "p2p"):
            raise ValueError(f"pp_style={pp_style!r} needs pp_size > 1 and p2p_transport='p2p'.")
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))  # (for warnings)
        nodes = schedule_from_nodes(scheduler_nodes, pp_style, layout, num_microbatches, rank)
        self.sp_mode = resolve_mode(enable_sequence_parallelism, sequence_parallelism_mode, sp_size, tp_size, rank)
        if max_norm < 0:
            raise ValueError(f"max_norm={max_norm} must be >= 0 (0 turns clipping off).")
        if ddp_bucket_cap_mb <= 0:
            raise ValueError(f"ddp_bucket_cap_mb={ddp_bucket_cap_mb} must be > 0.")
        if p2p_transport not in ("p2p", "broadcast"):
            raise ValueError(f"p2p_transport={p2p_transport!r}: use 'p2p' or 'broadcast'.")
        if pp_schedule_costs not in ("measured", "unit"):
            raise ValueError(f"pp_schedule_costs={pp_schedule_costs!r}: use 'measured' or 'unit'.")
        if pp_schedule_costs == "measured" and pp_style in V_STYLES and num_microbatches is None:
            raise ValueError("pp_schedule_costs='measured' re-plans at a step every rank takes together: give "
                             "num_microbatches (the same on every replica).")
        check_int("make_vocab_size_divisible_by", make_vocab_size_divisible_by, 1)
        custom_policy = as_policy(custom_policy)  # ours as is, Parallelformers-style translated, else TypeError
        if loss_weight_fn is not None and pp_size == 1 and not (num_microbatches or microbatch_size):
            raise ValueError("loss_weight_fn weighs the microbatches of execute_pipeline: also give num_microbatches "
                             "(or microbatch_size).")
        if pp_size > 1 and num_microbatches is not None:
            make_schedule(pp_style, pp_size, num_model_chunks, num_microbatches)  # e.g. m < p: a clear error
        if on_nonfinite not in ("skip", "raise", "ignore"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r}: use 'skip', 'raise' or 'ignore'.")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout={timeout} must be a positive number of seconds.")
        ensure_distributed(timeout or DEFAULT_TIMEOUT_S, explicit=timeout is not None)
        agree_on_layout(tp_size=tp_size, pp_size=pp_size, num_microbatches=num_microbatches or 0,
                         microbatch_size=microbatch_size or 0, zero_stage=zero_stage,
                         precision=_SUPPORTED_PRECISIONS.index(precision), check_batches=int(check_batches),
                         num_model_chunks=num_model_chunks, pp_schedule_costs=int(pp_schedule_costs == "measured"),
                         scheduler_nodes=fingerprint(nodes),
                         sequence_parallelism_mode=(None, *SEQUENCE_PARALLEL_MODES).index(self.sp_mode))
        self.failure_guard = FailureGuard.shared()
        world = dist.get_world_size()
        if world % (tp_size * pp_size):
            raise ValueError(f"World size {world} is not divisible by tp_size * pp_size = {tp_size} * {pp_size}; "
                             f"launch a multiple of {tp_size * pp_size} processes or change the sizes.")
        self.tp_size, self.pp_size = tp_size, pp_size
        self.dp_size = world // (tp_size * pp_size)
        if zero_stage > 0 and self.dp_size == 1:
            raise ValueError(f"zero_stage={zero_stage} partitions over data parallel, but dp size is 1 (world {world} "
                             f"= tp_size {tp_size} * pp_size {pp_size}): use zero_stage=0 or more processes.")
        self.zero_stage = zero_stage
        self.precision, self.max_norm, self.custom_policy = precision, max_norm, custom_policy
        self.parallel_output, self.make_vocab_size_divisible_by = parallel_output, make_vocab_size_divisible_by
        self.seed, self.check_batches, self.on_nonfinite = seed, check_batches, on_nonfinite
        self.timeout = float(timeout or DEFAULT_TIMEOUT_S)
        self.pp_style, self.num_model_chunks = pp_style, num_model_chunks
        self.bucket_bytes = int(ddp_bucket_cap_mb * 1024 * 1024)
        self.device = default_device()

        self.pg_mesh = ProcessGroupMesh(self.dp_size, pp_size, tp_size,
                                        timeout=timedelta(seconds=self.timeout))
        self.dp_group = self.pg_mesh.get_group_along_axis(DP_AXIS)
        self.tp_group = self.pg_mesh.get_group_along_axis(TP_AXIS)
        self._stage_manager = PipelineStageManager(self.pg_mesh, PP_AXIS, num_model_chunks=num_model_chunks,
                                                   num_layers_per_stage=num_layers_per_stage, layout_style=layout.style)
        self.pp_group = self._stage_manager.pp_group
        self.dp_rank = self.pg_mesh.coordinate[DP_AXIS]
        self.tp_rank = self.pg_mesh.coordinate[TP_AXIS]
        self.schedule = None
        self.loss_weight_fn = loss_weight_fn
        # pp > 1 without a microbatch setting: each step picks the number of microbatches from its batch size
        self.auto_microbatches = pp_size > 1 and num_microbatches is None and microbatch_size is None
        if pp_size > 1 or num_microbatches or microbatch_size:
            p2p = PipelineP2PCommunication(self._stage_manager, self.device, transport=p2p_transport,
                                           enable_metadata_cache=enable_metadata_cache)
            self.schedule = PipelineSchedule(self._stage_manager, p2p,
                                             min_microbatches(pp_style, pp_size) if self.auto_microbatches
                                             else num_microbatches,
                                             microbatch_size, pp_style, pp_schedule_costs == "measured")
            if nodes is not None:
                self.schedule.use_schedule(nodes)
            if loss_weight_fn is not None:
                self.schedule.loss_scales_fn = token_weighted_scales(loss_weight_fn, self.dp_group, self.device)
            if trace if trace is not None else os.environ.get("HP_TRACE", "0") not in ("", "0"):
                self.schedule.tracer = ScheduleTracer(self._stage_manager.stage, pp_size)

    @property
    def stage_manager(self) -> Optional[PipelineStageManager]:
        """The pipeline stage manager; None without pipeline parallelism (pp_size == 1), as in ColossalAI."""
        return self._stage_manager if self.pp_size > 1 else None

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (0 without pipeline parallelism)."""
        return self._stage_manager.stage

    def is_first_stage(self) -> bool:
        return self._stage_manager.is_first_stage()

    def is_last_stage(self) -> bool:
        return self._stage_manager.is_last_stage()

    # -- boosting ---------------------------------------------------------------------------------------
    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        if optimizer is not None and self.zero_stage > 0:
            check_zero_optimizer(optimizer, self.zero_stage)
        model, peft_model = split_peft_model(model)  # a LoRA model: shard the transformers model inside it
        refuse_boosted_twice(model)
        lora = None
        if peft_model is not None:
            materialize_adapters(peft_model)  # built on the meta device: peft's own init for the small adapters
            lora = LoRAState(peft_model, adapter_file_keys(peft_model))
        param_names: Dict[int, list] = {}
        for name, p in model.named_parameters(remove_duplicate=False):  # a tied parameter has several names
            param_names.setdefault(id(p), []).append(name)
        policy = self.custom_policy if self.custom_policy is not None else get_autopolicy(model)
        # the unsharded layout (names, shapes, dtypes, holding stages), for checkpoints in HF format
        full_params = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}
        batch_limits = BatchLimits(vocab_of(model), label_vocab_of(model),
                                   sequence_multiple=self.tp_size if self.sp_mode else 1)
        rng_tracker = None
        if self.tp_size > 1:
            from shardformer.layer.dropout import TPRNGTracker
            rng_tracker = TPRNGTracker(self.device)
            # dropout masks the same across tp, not dp; drawn from the tracker, the script's global RNG is left alone
            rng_tracker.sync(self.tp_group, self.seed + self.dp_rank)
        shard_config = ShardConfig(
            tensor_parallel_process_group=self.tp_group if self.tp_size > 1 else None,
            pipeline_stage_manager=self.stage_manager,
            parallel_output=self.parallel_output, make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
            rng_tracker=rng_tracker, enable_sequence_parallelism=self.sp_mode is not None,
            sequence_parallelism_mode=self.sp_mode)
        sharder = Sharder(model, policy, shard_config)
        if self.custom_policy is not None:  # a plan written by hand: an entry matching nothing is a typo
            policy.check_plan()
        shared_names = sharder.shard()
        remember_boosted(model)  # sharded in place: boosting this object again is refused
        if self.pp_style in V_STYLES:  # their backward is split into I and W (pipeline/split_backward.py)
            prepare_split_backward(model)
        per_stage = policy.layers_per_stage() if self.pp_size > 1 else [policy.num_layers()]
        layout = self._stage_manager.layout  # checkpointing counts per pipeline rank: a rank's chunks together
        apply_activation_checkpointing(model, list(policy.layer_list()), self.stage,
                                       [sum(per_stage[s] for s in layout.stages_of(r)) for r in range(self.pp_size)],
                                       self.gradient_checkpoint_config, rng_tracker)
        if self.precision in _DTYPES:
            model.to(_DTYPES[self.precision])
        sharder._materialize(self.device)  # lazy init: a model built on the meta device gets only this rank's shard
        model.to(self.device)

        params = dict(model.named_parameters(remove_duplicate=False))
        shared = []
        for names in shared_names:  # every rank creates every group, in the same order
            stages = sorted(names)
            group = self.pg_mesh.get_group_along_axis(PP_AXIS, indices=stages)
            if self.stage in names:
                shared.append((params[names[self.stage]], group, self.stage == stages[0]))
        module = HybridParallelModule(model, sharder.stage_forward, self.dp_group if self.dp_size > 1 else None,
                                      self.tp_group if self.tp_size > 1 else None,
                                      self.pp_group if self.pp_size > 1 else None, shared, self.zero_stage,
                                      bucket_bytes=self.bucket_bytes, failure_guard=self.failure_guard)
        module.policy, module.full_params, module.batch_limits = policy, full_params, batch_limits
        module.lora = lora
        module.sync_params()
        if self.pp_size > 1:  # a stage alone cannot run the model: only the schedule may call it
            refuse_calls_outside_schedule((module, model), self._stage_manager)
        if self.check_batches and self.tp_size > 1 and self.pp_size == 1:  # `model(**batch)` agrees over tp first
            module.register_forward_pre_hook(DirectCallCheck(batch_limits, self.dp_rank, self.tp_group, self.device),
                                             with_kwargs=True)
        guard_parameters(module)  # an optimizer that skips boost is refused at its step
        if optimizer is not None:
            _rebind_optimizer(optimizer, param_names, params)
            wrapper = ZeroOptimizer if self.zero_stage > 0 else HybridParallelOptimizer
            scaler = DynamicLossScaler(self.scaler_config, self.device) if self.precision == "fp16" else None
            optimizer = wrapper(optimizer, module, self.max_norm, tracer=self.schedule.tracer if self.schedule else None,
                                master_dtype=torch.float32 if self.precision != "fp32" else None, scaler=scaler,
                                on_nonfinite=self.on_nonfinite)
        return module, optimizer, criterion, dataloader, lr_scheduler

    def execute_pipeline(self, data_iter: Iterator, model: HybridParallelModule, criterion: Callable,
                         optimizer: Optional[HybridParallelOptimizer] = None, return_loss: bool = True,
                         return_outputs: bool = False) -> Dict[str, Any]:
        """One step over microbatches (see Booster.execute_pipeline): forwards and backwards, or forwards only under
        torch.no_grad() or with the model in eval mode and no optimizer (evaluation)."""
        check_step_arguments(model, criterion, optimizer)  # every rank alike, before anything runs
        trains = torch.is_grad_enabled() and (optimizer is not None or model.unwrap().training)
        check_criterion(criterion, trains)
        if self.schedule is None:
            raise ValueError("execute_pipeline needs num_microbatches or microbatch_size in HybridParallelPlugin.")
        self.failure_guard.check()
        try:
            batch = next(data_iter)
        except StopIteration:
            raise ValueError("execute_pipeline got an exhausted data iterator: pass a fresh iter(dataloader) or stop "
                             "the loop when the dataloader ends.") from None
        if self.check_batches:  # one small all-gather: a bad batch anywhere raises the same error everywhere
            agree_on_batch(batch, model.batch_limits, lambda b: self._num_microbatches(b, model.batch_limits),
                           self.dp_rank, self.device)
        else:
            check_batch_content(batch, model.batch_limits)
        if self.auto_microbatches:
            self.schedule.num_microbatches = default_num_microbatches(batch, self.pp_size, self.pp_style)
        if self.loss_weight_fn is not None and criterion is not None:
            criterion = without_empty_microbatches(criterion, self.loss_weight_fn)
        if trains and model.grads_synced:  # every rank alike: they ran the same calls
            raise RuntimeError("This step's gradients were already reduced by an earlier execute_pipeline: call "
                               "optimizer.step()/zero_grad() first, or run all but the last accumulation step inside "
                               "`with booster.no_sync(model):`.")
        # a failure ends the step on every rank; evaluation runs forwards only, as under torch.no_grad()
        with self.failure_guard.step("execute_pipeline"), batch_agreed(), torch.set_grad_enabled(trains):
            result = self.schedule.forward_backward_step(model, iter([batch]), criterion, optimizer, return_loss,
                                                         return_outputs)
            if trains and model.require_grad_sync:  # `p.grad` final on return, as in one process
                model.sync_grads()
            if result["outputs"] is not None:
                result["outputs"] = model.full_outputs(result["outputs"], result["loss"])
        return result

    def arrive(self, call: str) -> None:
        """Start of a collective call (checkpoints): a monitored barrier over the world, so that a call made on some
        ranks only (e.g. under `if rank == 0:`) fails within ARRIVAL_TIMEOUT_S (or the timeout, if shorter) naming
        the missing ranks, on the ranks that arrived, and is published to the others (their next step raises
        RankFailure; one blocked in a step exits). Backends without monitored barriers (NCCL alone) skip it."""
        self.failure_guard.check()
        window = min(self.timeout, ARRIVAL_TIMEOUT_S)
        with self.failure_guard.step(call):
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=window), wait_all_ranks=True)
            except NotImplementedError:
                return
            except RuntimeError as error:
                raise RuntimeError(f"{call} is collective: every rank must call it (not only under `if rank == 0:`), "
                                   f"but some ranks did not reach it within {window:.0f} s of the first ({error})."
                                   ) from None

    def _num_microbatches(self, batch: Any, limits: BatchLimits) -> int:
        """How this step splits `batch` (raises as the schedule would on a batch that does not split, or on an empty
        batch or labels the model cannot take)."""
        check_batch_content(batch, limits)
        try:
            if self.auto_microbatches:
                m, size = default_num_microbatches(batch, self.pp_size, self.pp_style), None
            else:
                m, size = self.schedule.num_microbatches, self.schedule.microbatch_size
            m = len(split_batch(batch, m, size))
        except ValueError as error:  # e.g. the short last batch of an epoch
            raise ValueError(f"{error} If this is the last batch of an epoch (a dataset size that is not a multiple "
                             f"of the batch size), drop it: prepare_dataloader(..., drop_last=True), the default "
                             f"with microbatches, or DataLoader(drop_last=True).") from None
        if self.pp_size > 1:
            self.schedule.plan(m)  # e.g. m < p: the schedule's error (the plan is kept for the step)
        return m

    def write_trace(self, out_dir: str) -> Optional[Dict[str, float]]:
        """Collective: write the recorded schedule timeline (trace.json, timeline.png, bubble.json) from rank 0.

        Needs `trace=True` (or HP_TRACE=1); returns the bubble summary on rank 0."""
        tracer = self.schedule.tracer if self.schedule else None
        if tracer is None:
            raise ValueError("No trace was recorded: create the plugin with trace=True or set HP_TRACE=1.")
        return tracer.gather_and_write(out_dir)

    def prepare_dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = False, seed: int = 1024,
                           drop_last: Optional[bool] = None, pin_memory: bool = False, num_workers: int = 0,
                           **kwargs: Any) -> DataLoader:
        """A DataLoader over this rank's data-parallel shard: pp and tp ranks of one replica see the same batches.

        `drop_last` (sampler and loader): None (default) drops the short last batch of an epoch where steps split
        their batch into microbatches (pp_size > 1, num_microbatches or microbatch_size), since it would not
        split, and keeps it otherwise (ColossalAI's default is False); give False to keep every sample."""
        if drop_last is None:
            drop_last = self.schedule is not None
        sampler = DistributedSampler(dataset, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=shuffle,
                                     seed=seed, drop_last=drop_last)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                          pin_memory=pin_memory, num_workers=num_workers, **kwargs)


def _rebind_optimizer(optimizer: torch.optim.Optimizer, names: Dict[int, list], params: Dict[str, nn.Parameter]) -> None:
    """Point the optimizer at this stage's (possibly re-created, sharded) parameters, by name; drop the rest."""
    if optimizer.state:
        raise ValueError("Boost the optimizer before its first step: it already has state for unsharded parameters.")
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
