"""HybridParallelPlugin: dp × pp × tp over the world, with ColossalAI's argument names."""
from __future__ import annotations

import warnings
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, SupportsFloat, Type

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils._pytree import tree_map_only
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from pipeline import PipelineP2PCommunication, PipelineSchedule, PipelineStageManager, ProcessGroupMesh
from pipeline.context import ParallelContext
from pipeline.step import MicroBatch, StepOptions
from pipeline.trace import ScheduleTracer
from shardformer.policies import Policy
from shardformer.shard_config import ShardConfig

from ..compat.v_schedule import ScheduleNode
from ..core.activation_checkpoint import GradientCheckpointConfig
from ..guards.batch_check import BatchLimits, agree_on_batch, batch_agreed
from .config import PluginConfig
from ..guards.failure import FailureGuard
from .base import PipelineResult
from .hybrid_base import HybridPluginBase
from ..guards.launch import ARRIVAL_TIMEOUT_S, agree_on_layout, arrival_barrier, default_device, ensure_distributed
from ..core.microbatches import MicrobatchSplit, token_weighted_scales, without_empty_microbatches
from ..core.optimizer import HybridParallelOptimizer
from ..core.parallel_module import HybridParallelModule
from .prepare import PrepareOptions, prepare_model, shard_config_of
from ..core.stage_calls import chunk_calls, running_step
from .usage_checks import check_batch_content, check_criterion, check_step_arguments


class HybridParallelPlugin(HybridPluginBase):
    """Tensor parallel inside each stage, pipeline across stages, data parallel over the rest of the world.

    Takes every argument of ColossalAI 0.5's HybridParallelPlugin by name (those it does not act on are listed in
    `compat/colossal_args.py`: a speed-only option is accepted with a warning, a result-changing one is refused).

    Args:
        tp_size, pp_size: tensor- and pipeline-parallel sizes (`tp`, `pp` are aliases); dp = world / (tp * pp).
        ep_size: expert parallel (mixture-of-experts models): each MoE layer's routed experts are split over ep
            ranks carved out of dp (dp = moe_dp * ep; ep must divide dp and the number of experts), a rank holds
            E / ep experts whole and tokens travel to them by all-to-all; with tp_size > 1 each held expert is also
            split over tp as transformers' `moe_tp_experts` plan does. Router, shared experts and every other
            parameter stay replicated over ep (gradients averaged over dp); expert gradients are averaged over
            moe_dp. See MoeHybridParallelPlugin for ColossalAI's MoE arguments.
        dp_outside: the rank order of the mesh, as ColossalAI's: data-parallel replicas outermost (default; ranks
            (dp, pp, ep, tp), tp innermost) or, False, pipeline stages outermost (pp, dp, ep, tp).
        num_microbatches, microbatch_size: either, or both when every batch holds their product (as ColossalAI,
            checked at each step); with pp_size > 1 and neither, each step picks the largest
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
        chunked_loss, loss_chunk_size: where the model's loss is transformers' causal-LM loss, a training forward
            with labels computes it `loss_chunk_size` tokens at a time (None: chosen from the shapes) and never
            holds the full logits: the model then returns `logits=None` (`execute_pipeline(...,
            return_outputs=True)`, eval mode and calls without labels compute them). Unset or True: on (also
            ColossalAI's `enable_all_optimization=True`); False: off. shardformer/chunked_loss.py.
        enable_sequence_parallelism, sequence_parallelism_mode: split the sequence over the tp group between the
            first and last decoder layer (needs tp_size > 1 and sequence lengths divisible by it; training mode only):
            "split_gather" (default; Megatron-LM: weights tensor-split, all-gather into and reduce-scatter out of the
            attention/MLP) or "all_to_all" (DeepSpeed-Ulysses: decoder-layer weights replicated over the tp group,
            heads exchanged for sequence around attention). `sp_size` (ColossalAI's separate group): unset or 1.
        enable_metadata_cache: send P2P shapes only when they change.
        ddp_bucket_cap_mb: size of the data-parallel gradient buckets.
        p2p_transport: "p2p" (batched isend/irecv) or "broadcast".
        scheduler_nodes: ColossalAI's zbv order (`PipelineGraph(...).get_v_schedule()`, booster_plugin/compat/v_schedule.py),
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
        compile_layers: compile each decoder layer this rank holds with torch.compile (regional compilation,
            core/regional_compile.py; off by default: seconds to tens of seconds of compile per layer class).
        fused_kernels: "liger": the model's RMSNorm/LayerNorm modules replaced by Liger-Kernel's (CUDA, liger_kernel
            installed; refused elsewhere); None (default): the model's own. core/fused_kernels.py.
        attn_implementation: set on the model before sharding (transformers' name: "sdpa", "flash_attention_2",
            "eager", ...; "auto": flash_attention_2 where installed on CUDA, else sdpa); None (default): the
            model's own. core/attention_choice.py.
        enable_all_optimization, enable_fused_normalization, enable_flash_attention, enable_jit_fused: ColossalAI's
            switches, mapped onto ours (plugins/speed.py): jit_fused -> compile_layers; fused_normalization ->
            fused_kernels="liger" where Liger runs, else compile_layers; flash_attention -> attn_implementation=
            "auto"; all_optimization -> all of them and the chunked loss.
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
                 pp_schedule_costs: str = "unit", scheduler_nodes: Optional[Sequence[Sequence[ScheduleNode]]] = None,
                 seed: int = 1024, trace: Optional[bool] = None,
                 loss_weight_fn: Optional[Callable[[MicroBatch], SupportsFloat]] = None,
                 timeout: Optional[float] = None,
                 check_batches: bool = True, on_nonfinite: str = "skip",
                 initial_scale: float = 2 ** 16, growth_factor: float = 2, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2, min_scale: float = 1, max_scale: float = 2 ** 32,
                 gradient_checkpoint_config: Optional[GradientCheckpointConfig] = None, compile_layers: bool = False,
                 ep_size: int = 1, dp_outside: bool = True, chunked_loss: Optional[bool] = None,
                 loss_chunk_size: Optional[int] = None, tp: Optional[int] = None, pp: Optional[int] = None,
                 fused_kernels: Optional[str] = None, attn_implementation: Optional[str] = None,
                 enable_all_optimization: bool = False, enable_fused_normalization: bool = False,
                 enable_flash_attention: bool = False, enable_jit_fused: bool = False,
                 **colossalai_kwargs: Any) -> None:
        # every check before the first collective, so that bad input fails the same way on every rank
        args = {k: v for k, v in locals().items() if k not in ("self", "colossalai_kwargs")}
        self.config = config = PluginConfig.from_arguments(args, colossalai_kwargs)
        ensure_distributed(config.mesh.timeout, explicit=config.mesh.timeout_given)
        agree_on_layout(**config.agreement())
        self.failure_guard = FailureGuard.shared()
        world, tp_size, pp_size = dist.get_world_size(), config.mesh.tp_size, config.mesh.pp_size
        sp_size = config.sharding.sp_size  # (> 1: a group of its own)
        dp_size = config.mesh.dp_size(world, sp_size)
        # the settings the model and optimizer are prepared with: ZeRO over one dp rank partitions nothing, so it runs
        # as zero_stage=0 (ColossalAI runs it too, warning that it only adds overhead)
        self._precision_in_effect = config.precision
        if config.precision.zero_stage > 0 and dp_size == 1:
            self._precision_in_effect = replace(config.precision, zero_stage=0)
            if dist.get_rank() == 0:
                warnings.warn(f"zero_stage={config.precision.zero_stage} partitions over data parallel, but dp size is "
                              f"1 (world {world} = tp_size {tp_size} * pp_size {pp_size}): nothing is partitioned, "
                              f"training runs as with zero_stage=0. Set zero_stage=0 to silence this.", stacklevel=2)
        self.device = default_device()
        self.ctx = ParallelContext.build({"dp": dp_size, "pp": pp_size, "tp": tp_size, "ep": config.mesh.ep_size,
                                          "sp": sp_size},
                                         timedelta(seconds=config.mesh.timeout), dp_outside=config.mesh.dp_outside,
                                         sequence_over_tp=config.sharding.sp_mode is not None)
        pipe = config.pipeline
        self._stage_manager = PipelineStageManager(
            self.ctx.mesh, self.ctx.pp.index, num_model_chunks=pipe.num_model_chunks,
            num_layers_per_stage=pipe.num_layers_per_stage,
            layout_style=pipe.style.layout(pp_size, pipe.num_model_chunks).style)
        # pp > 1 without a microbatch setting: each step picks the number of microbatches from its batch size
        self.microbatching = MicrobatchSplit(pipe.num_microbatches, pipe.microbatch_size, pipe.style, pp_size)
        self.schedule: Optional[PipelineSchedule] = None
        self._loss_weights = None  # microbatches -> their LossWeights (token-weighted loss)
        if pipe.runs_schedule(pp_size):
            p2p = PipelineP2PCommunication(self._stage_manager, self.device, transport=pipe.p2p_transport,
                                           enable_metadata_cache=pipe.metadata_cache)
            self.schedule = PipelineSchedule(self._stage_manager, p2p, pipe.style, pipe.measured_costs,
                                             ScheduleTracer(self._stage_manager.stage, pp_size) if pipe.trace else None)
            if pipe.nodes is not None:
                self.schedule.use_schedule(pipe.nodes)
            if pipe.loss_weight_fn is not None:
                self._loss_weights = token_weighted_scales(pipe.loss_weight_fn, self.dp_group, self.device)

    @property
    def timeout(self) -> float:
        """Seconds a collective may wait before every rank fails."""
        return self.config.mesh.timeout

    @property
    def make_vocab_size_divisible_by(self) -> int:
        return self.config.sharding.make_vocab_size_divisible_by

    @property
    def sp_mode(self) -> Optional[str]:
        """The sequence-parallel mode in effect (None: off)."""
        return self.config.sharding.sp_mode

    @property
    def precision(self) -> str:
        return self.config.precision.precision

    @property
    def zero_stage(self) -> int:
        """As given, as in ColossalAI (with dp size 1 training runs as zero_stage=0: nothing to partition)."""
        return self.config.precision.zero_stage

    @property
    def max_norm(self) -> float:
        return self.config.precision.max_norm

    # -- the mesh, by ColossalAI's names (the named axes are in self.ctx) -------------------------------------
    @property
    def pg_mesh(self) -> ProcessGroupMesh:
        return self.ctx.mesh

    @property
    def dp_size(self) -> int:
        return self.ctx.dp.size

    @property
    def pp_size(self) -> int:
        return self.ctx.pp.size

    @property
    def tp_size(self) -> int:
        return self.ctx.tp.size

    @property
    def dp_rank(self) -> int:
        return self.ctx.dp.rank

    @property
    def tp_rank(self) -> int:
        return self.ctx.tp.rank

    @property
    def dp_group(self) -> ProcessGroup:
        return self.ctx.dp.group

    @property
    def pp_group(self) -> ProcessGroup:
        return self.ctx.pp.group

    @property
    def tp_group(self) -> ProcessGroup:
        return self.ctx.tp.group

    @property
    def mixed_dp_group(self) -> ProcessGroup:
        """ColossalAI's group that gradients are reduced over (dp × sp with a separate sp group): here dp."""
        return self.ctx.dp.group

    @property
    def sp_group(self) -> ProcessGroup:
        """ColossalAI's sequence-parallel group: the sp group of its own ("all_to_all"/"ring_attn" with sp_size > 1),
        the tp group where sequence parallelism runs over tp, else a group of this rank alone (sp size 1), as in
        ColossalAI."""
        return self.ctx.seq.group

    @property
    def shard_config(self) -> ShardConfig:
        """How the model is sharded (ColossalAI's name; ours, shardformer.shard_config.ShardConfig): the tp group
        (None without tp), the stage manager (None without pp), parallel_output, vocabulary padding, sequence
        parallelism. Read-only: the plugin's arguments set it."""
        return shard_config_of(self.config.sharding, self.ctx, self._stage_manager)

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
        """Boost: shard `model` for this rank and wrap it and `optimizer` (booster_plugin/plugins/prepare.py)."""
        opts = PrepareOptions(self.config.sharding, self._precision_in_effect, self.config.pipeline.style,
                              self.config.check_batches, self.device)
        module, optimizer = prepare_model(model, optimizer, opts, self.ctx, self._stage_manager, self.failure_guard,
                                          self.schedule.tracer if self.schedule else None)
        return module, optimizer, criterion, dataloader, lr_scheduler

    def execute_pipeline(self, data_iter: Iterator[Mapping[str, object]], model: HybridParallelModule,
                         criterion: Optional[Callable], optimizer: Optional[HybridParallelOptimizer] = None,
                         return_loss: bool = True, return_outputs: bool = False) -> PipelineResult:
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
        # a dataloader's CPU tensors go to this rank's device, as a schedule's own batch would be
        batch = tree_map_only(torch.Tensor, lambda t: t.to(self.device, non_blocking=True), batch)
        microbatches = None  # unchecked: split in the step, so a batch that does not split fails it on every rank
        if self.config.check_batches:  # one small all-gather: a bad batch anywhere raises the same error everywhere
            microbatches = self._agreed_microbatches(batch, model.batch_limits)
        else:
            check_batch_content(batch, model.batch_limits)
        if self.config.pipeline.loss_weight_fn is not None and criterion is not None:
            criterion = without_empty_microbatches(criterion, self.config.pipeline.loss_weight_fn)
        if trains:  # accumulation over calls without no_sync (as ColossalAI): this call reduces its part too
            model.reopen_grads()
        # a failure ends the step on every rank; evaluation runs forwards only, as under torch.no_grad()
        with self.failure_guard.step("execute_pipeline"), batch_agreed(), running_step(self._stage_manager), \
                torch.set_grad_enabled(trains), model.full_logits(return_outputs):
            if microbatches is None:
                microbatches = self.microbatching.split(batch, model.batch_limits.ragged)
            weights = self._loss_weights(microbatches) if self._loss_weights is not None else None
            options = StepOptions(return_loss, return_outputs, weights,
                                  optimizer.backward if optimizer is not None else None,
                                  reducer=model if trains else None)
            result = self.schedule.forward_backward_step(chunk_calls(model, self.config.pipeline.num_model_chunks), microbatches,
                                                         criterion, options)
            outputs = model.full_outputs(result.outputs, result.loss) if result.outputs is not None else None
        return {"loss": result.loss, "outputs": outputs}

    def arrive(self, call: str) -> None:
        """Start of a collective call (checkpoints): a monitored barrier over the world, so that a call made on some
        ranks only (e.g. under `if rank == 0:`) fails within ARRIVAL_TIMEOUT_S (or the timeout, if shorter) naming
        the missing ranks, on the ranks that arrived, and is published to the others (their next step raises
        RankFailure; one blocked in a step exits). Backends without monitored barriers (NCCL alone) skip it."""
        self.failure_guard.check()
        window = min(self.timeout, ARRIVAL_TIMEOUT_S)
        with self.failure_guard.step(call):
            arrival_barrier(call, window)

    def _agreed_microbatches(self, batch: object, limits: BatchLimits) -> List[MicroBatch]:
        """This step's microbatches, split once while every rank agrees on its batch (collective)."""
        split: List[List[MicroBatch]] = []  # the split the agreement makes (it counts the microbatches)

        def count(b: object) -> int:
            split.append(self._microbatches(b, limits))
            return len(split[0])

        with self.failure_guard.waiting():  # a frozen or failed peer ends this wait too, named
            agree_on_batch(batch, limits, count, self.dp_rank, self.device)
        return split[0]

    def _microbatches(self, batch: object, limits: BatchLimits) -> List[MicroBatch]:
        """How this step splits `batch` (raises as the step would on a batch that does not split, or on an empty
        batch or labels the model cannot take); planned for."""
        check_batch_content(batch, limits)
        try:
            microbatches = self.microbatching.split(batch, limits.ragged)
        except ValueError as error:  # e.g. the short last batch of an epoch
            raise ValueError(f"{error} If this is the last batch of an epoch (a dataset size that is not a multiple "
                             f"of the batch size), drop it: prepare_dataloader(..., drop_last=True), the default "
                             f"with microbatches, or DataLoader(drop_last=True).") from None
        if self.pp_size > 1:
            self.schedule.plan(len(microbatches))  # e.g. m < p: the schedule's error (the plan is kept for the step)
        return microbatches

    def write_trace(self, out_dir: str) -> Optional[Dict[str, float]]:
        """Collective: write the recorded schedule timeline (trace.json, timeline.png, bubble.json) from rank 0.

        Needs `trace=True` (or HP_TRACE=1); returns the bubble summary on rank 0."""
        tracer = self.schedule.tracer if self.schedule else None
        if tracer is None:
            raise ValueError("No trace was recorded: create the plugin with trace=True or set HP_TRACE=1.")
        return tracer.gather_and_write(out_dir)

    def prepare_dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = False, seed: int = 1024,
                           drop_last: Optional[bool] = None, pin_memory: bool = False, num_workers: int = 0,
                           distributed_sampler_cls: Optional[Type[DistributedSampler]] = None,
                           **kwargs: Any) -> DataLoader:
        """A DataLoader over this rank's data-parallel shard: pp and tp ranks of one replica see the same batches.

        `drop_last` (sampler and loader): None (default) drops the short last batch of an epoch where steps split
        their batch into microbatches (pp_size > 1, num_microbatches or microbatch_size), since it would not
        split, and keeps it otherwise (ColossalAI's default is False); give False to keep every sample.
        `distributed_sampler_cls`: the sampler's class (default DistributedSampler), built with the same arguments,
        e.g. `StatefulDistributedSampler` (booster_plugin.samplers) to resume mid-epoch."""
        if drop_last is None:
            drop_last = self.schedule is not None
        sampler_cls = distributed_sampler_cls or DistributedSampler
        sampler = sampler_cls(dataset, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=shuffle, seed=seed,
                              drop_last=drop_last)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                          pin_memory=pin_memory, num_workers=num_workers, **kwargs)

