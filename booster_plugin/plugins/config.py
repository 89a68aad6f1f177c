"""The plugin's configuration: ColossalAI's keyword arguments, validated by the lower layers' own checks (one check,
one place) into a few small frozen parts, before any collective, so that bad input fails alike on every rank.

    PluginConfig
      mesh      MeshConfig       tp, pp and ep sizes (dp is what the world leaves), the mesh order, the timeout
      pipeline  PipelineConfig   schedule style, microbatching, layer split, P2P, trace, token weights
      sharding  ShardingConfig   policy, vocab-parallel output, sequence parallelism, dropout seed, checkpointing,
                                 chunked loss
      precision PrecisionConfig  dtype, ZeRO, clipping, fp16 loss scaler, non-finite gradients, DP buckets
      check_batches              the per-step batch agreement (booster_plugin/guards/batch_check.py)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, SupportsFloat, Union

import torch.distributed as dist

from pipeline.actions import Schedule
from pipeline.step import MicroBatch
from pipeline.styles import ScheduleStyle, style_named
from shardformer.chunked_loss import check_chunk_size
from shardformer.policies.from_parallelformers import PolicyLike, as_policy
from shardformer.policies import Policy
from shardformer.sequence.parallel import SEQUENCE_PARALLEL_MODES, resolve_mode

from ..core.activation_checkpoint import GradientCheckpointConfig
from ..compat.colossal_args import check_unacted_args
from ..guards.launch import DEFAULT_TIMEOUT_S, alias, check_int, default_device
from ..core.mixed_precision import LossScalerConfig
from ..compat.v_schedule import ScheduleNode, fingerprint, schedule_from_nodes
from .speed import COLOSSALAI_SPEED_SWITCHES, SpeedConfig

__all__ = ["PRECISIONS", "MeshConfig", "PipelineConfig", "ShardingConfig", "PrecisionConfig", "PluginConfig"]

PRECISIONS = ("fp32", "bf16", "fp16")


def _rank() -> int:
    """This rank (for warnings printed once), also before torch.distributed is initialized."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class MeshConfig:
    tp_size: int
    pp_size: int
    ep_size: int          # expert parallel, carved out of dp (dp = moe_dp * ep)
    dp_outside: bool      # replicas outermost in the mesh (ColossalAI's moe_dp_outside); False: stages outermost
    timeout: float        # seconds a collective may wait (DEFAULT_TIMEOUT_S unless given)
    timeout_given: bool   # given: also applied to a world group the script initialized itself

    @classmethod
    def build(cls, tp_size: int, pp_size: int, timeout: Optional[float], ep_size: int = 1,
              dp_outside: bool = True) -> "MeshConfig":
        check_int("tp_size", tp_size, 1)
        check_int("pp_size", pp_size, 1)
        check_int("ep_size", ep_size, 1)
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout={timeout} must be a positive number of seconds.")
        return cls(tp_size, pp_size, ep_size, bool(dp_outside), float(timeout or DEFAULT_TIMEOUT_S),
                   timeout is not None)

    def dp_size(self, world: int, sp: int = 1) -> int:
        """The data-parallel size the world leaves; raises (alike on every rank, before any collective) when the
        world does not split into tp × sp × pp × dp with ep dividing dp."""
        tp, pp, ep = self.tp_size, self.pp_size, self.ep_size
        if world % (tp * pp * sp):
            sizes = f"tp_size * pp_size{' * sp_size' if sp > 1 else ''} = {tp} * {pp}{f' * {sp}' if sp > 1 else ''}"
            raise ValueError(f"World size {world} is not divisible by {sizes}; launch a multiple of {tp * pp * sp} "
                             f"processes or change the sizes.")
        dp = world // (tp * pp * sp)
        if dp % ep:
            raise ValueError(f"ep_size={ep} must divide the data-parallel size {dp} (world {world} / (tp_size {tp} "
                             f"* pp_size {pp})): expert parallelism splits the data-parallel ranks into ep groups "
                             f"of moe_dp = dp / ep replicas. Launch a multiple of {tp * pp * ep} processes or "
                             f"change ep_size.")
        return dp


@dataclass(frozen=True)
class PipelineConfig:
    style: ScheduleStyle
    num_model_chunks: int
    num_microbatches: Optional[int]
    microbatch_size: Optional[int]
    num_layers_per_stage: Union[Sequence[int], str, None]
    p2p_transport: str
    metadata_cache: bool
    measured_costs: bool              # pp_schedule_costs="measured"
    nodes: Optional[Schedule]         # ColossalAI's scheduler_nodes, as a schedule
    trace: bool
    loss_weight_fn: Optional[Callable[[MicroBatch], SupportsFloat]]

    @classmethod
    def build(cls, pp_size: int, num_microbatches: Optional[int], microbatch_size: Optional[int], pp_style: str,
              num_model_chunks: int, num_layers_per_stage: Union[Sequence[int], str, None], p2p_transport: str,
              enable_metadata_cache: bool, pp_schedule_costs: str,
              scheduler_nodes: Optional[Sequence[Sequence[ScheduleNode]]], trace: Optional[bool],
              loss_weight_fn: Optional[Callable[[MicroBatch], SupportsFloat]]) -> "PipelineConfig":
        if num_microbatches is not None:
            check_int("num_microbatches", num_microbatches, 1)
        if microbatch_size is not None:
            check_int("microbatch_size", microbatch_size, 1)
        if isinstance(num_layers_per_stage, str) and num_layers_per_stage != "auto":
            raise ValueError(f"num_layers_per_stage must be a list, None or 'auto', got {num_layers_per_stage!r}.")
        style = style_named(pp_style)  # "1f1b", "interleaved", "zbv" or "dualpipev"
        layout = style.layout(pp_size, num_model_chunks)
        if pp_size < style.min_ranks or (p2p_transport != "p2p" and not style.runs_on_broadcast):
            raise ValueError(f"pp_style={pp_style!r} needs pp_size > 1 and p2p_transport='p2p'.")
        nodes = schedule_from_nodes(scheduler_nodes, pp_style, layout, num_microbatches, _rank())
        if p2p_transport not in ("p2p", "broadcast"):
            raise ValueError(f"p2p_transport={p2p_transport!r}: use 'p2p' or 'broadcast'.")
        if pp_schedule_costs not in ("measured", "unit"):
            raise ValueError(f"pp_schedule_costs={pp_schedule_costs!r}: use 'measured' or 'unit'.")
        if pp_schedule_costs == "measured" and style.replans_for_measured_costs and num_microbatches is None:
            raise ValueError("pp_schedule_costs='measured' re-plans at a step every rank takes together: give "
                             "num_microbatches (the same on every replica).")
        if loss_weight_fn is not None and pp_size == 1 and not (num_microbatches or microbatch_size):
            raise ValueError("loss_weight_fn weighs the microbatches of execute_pipeline: also give num_microbatches "
                             "(or microbatch_size).")
        if pp_size > 1 and num_microbatches is not None:
            style.make(pp_size, num_model_chunks, num_microbatches)  # e.g. m < p: a clear error
        traced = trace if trace is not None else os.environ.get("HP_TRACE", "0") not in ("", "0")
        return cls(style, num_model_chunks, num_microbatches, microbatch_size, num_layers_per_stage, p2p_transport,
                   enable_metadata_cache, pp_schedule_costs == "measured", nodes, traced, loss_weight_fn)

    def runs_schedule(self, pp_size: int) -> bool:
        """Whether execute_pipeline is available: a pipeline, or microbatches (gradient accumulation) at pp=1."""
        return pp_size > 1 or bool(self.num_microbatches or self.microbatch_size)


@dataclass(frozen=True)
class ShardingConfig:
    custom_policy: Optional[Policy]
    parallel_output: bool
    make_vocab_size_divisible_by: int
    sp_mode: Optional[str]            # sequence parallelism: None, "split_gather", "all_to_all", "ring_attn"
    sp_size: int                      # > 1: over a group of its own ("all_to_all", "ring_attn"); 1: over tp
    seed: int                         # dropout RNG seed under tp
    gradient_checkpoint_config: Optional[GradientCheckpointConfig]
    chunked_loss: bool                # the causal-LM loss in chunks, without the full logits, in training
    loss_chunk_size: Optional[int]    # tokens per chunk (None: chosen from the shapes)
    speed: SpeedConfig                # compiled layers, fused kernels, attention implementation (speed.py)

    @classmethod
    def build(cls, tp_size: int, pp_size: int, custom_policy: Union[None, Policy, PolicyLike, Sequence[PolicyLike]],
              parallel_output: bool,
              make_vocab_size_divisible_by: int, enable_sequence_parallelism: bool,
              sequence_parallelism_mode: Optional[str], sp_size: Optional[int], seed: int,
              gradient_checkpoint_config: Optional[GradientCheckpointConfig], chunked_loss: Optional[bool] = None,
              loss_chunk_size: Optional[int] = None, enable_all_optimization: bool = False,
              speed: Optional[SpeedConfig] = None) -> "ShardingConfig":
        if gradient_checkpoint_config is not None:
            gradient_checkpoint_config.check(pp_size)
        sp = resolve_mode(enable_sequence_parallelism, sequence_parallelism_mode, sp_size, tp_size, _rank())
        check_int("make_vocab_size_divisible_by", make_vocab_size_divisible_by, 1)
        check_chunk_size(loss_chunk_size)
        if enable_all_optimization and chunked_loss is False:
            raise ValueError("enable_all_optimization=True turns the chunked loss on, chunked_loss=False turns it off: "
                             "drop one of them.")
        policy = as_policy(custom_policy)  # ours as is, Parallelformers-style translated, else TypeError
        return cls(policy, parallel_output, make_vocab_size_divisible_by, sp.mode, sp.size, seed,
                   gradient_checkpoint_config, chunked_loss is not False, loss_chunk_size,
                   speed if speed is not None else SpeedConfig(False, None, None))


@dataclass(frozen=True)
class PrecisionConfig:
    precision: str
    zero_stage: int
    max_norm: float
    scaler: LossScalerConfig
    on_nonfinite: str
    bucket_bytes: int                 # data-parallel gradient buckets

    @classmethod
    def build(cls, precision: str, zero_stage: int, max_norm: float, scaler: LossScalerConfig, on_nonfinite: str,
              ddp_bucket_cap_mb: float) -> "PrecisionConfig":
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not supported; use one of {PRECISIONS}.")
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage={zero_stage!r} is not supported; use 0, 1 or 2.")
        if precision == "fp16":
            scaler.check()
        if max_norm < 0:
            raise ValueError(f"max_norm={max_norm} must be >= 0 (0 turns clipping off).")
        if ddp_bucket_cap_mb <= 0:
            raise ValueError(f"ddp_bucket_cap_mb={ddp_bucket_cap_mb} must be > 0.")
        if on_nonfinite not in ("skip", "raise", "ignore"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r}: use 'skip', 'raise' or 'ignore'.")
        return cls(precision, zero_stage, max_norm, scaler, on_nonfinite, int(ddp_bucket_cap_mb * 1024 * 1024))


@dataclass(frozen=True)
class PluginConfig:
    mesh: MeshConfig
    pipeline: PipelineConfig
    sharding: ShardingConfig
    precision: PrecisionConfig
    check_batches: bool

    @classmethod
    def from_arguments(cls, args: Dict[str, Any], colossalai_kwargs: Mapping[str, object]) -> "PluginConfig":
        """HybridParallelPlugin's arguments (by name) -> the validated configuration; raises on bad input."""
        a = dict(args)
        tp_size, pp_size = alias("tp", a.pop("tp"), "tp_size", a["tp_size"]), alias("pp", a.pop("pp"), "pp_size",
                                                                                    a["pp_size"])
        check_unacted_args(colossalai_kwargs, rank=None if dist.is_initialized() else _rank())
        mesh = MeshConfig.build(tp_size, pp_size, a["timeout"], a["ep_size"], a["dp_outside"])
        precision = PrecisionConfig.build(
            a["precision"], a["zero_stage"], a["max_norm"],
            LossScalerConfig(a["initial_scale"], a["growth_factor"], a["backoff_factor"], a["growth_interval"],
                             a["hysteresis"], a["min_scale"], a["max_scale"]), a["on_nonfinite"], a["ddp_bucket_cap_mb"])
        pipeline = PipelineConfig.build(
            pp_size, a["num_microbatches"], a["microbatch_size"], a["pp_style"], a["num_model_chunks"],
            a["num_layers_per_stage"], a["p2p_transport"], a["enable_metadata_cache"], a["pp_schedule_costs"],
            a["scheduler_nodes"], a["trace"], a["loss_weight_fn"])
        speed = SpeedConfig.build(a["compile_layers"], a["fused_kernels"], a["attn_implementation"],
                                  {k: a[k] for k in COLOSSALAI_SPEED_SWITCHES}, default_device(), _rank())
        sharding = ShardingConfig.build(
            tp_size, pp_size, a["custom_policy"], a["parallel_output"], a["make_vocab_size_divisible_by"],
            a["enable_sequence_parallelism"], a["sequence_parallelism_mode"], a["sp_size"], a["seed"],
            a["gradient_checkpoint_config"], a["chunked_loss"], a["loss_chunk_size"],
            bool(a["enable_all_optimization"]), speed)
        return cls(mesh, pipeline, sharding, precision, bool(a["check_batches"]))

    def agreement(self) -> Dict[str, int]:
        """The settings every rank must share (else they would build different groups or schedules and hang), as
        integers for one all-gather (launch.agree_on_layout)."""
        p = self.pipeline
        return dict(tp_size=self.mesh.tp_size, pp_size=self.mesh.pp_size, ep_size=self.mesh.ep_size,
                    moe_dp_outside=int(self.mesh.dp_outside), num_microbatches=p.num_microbatches or 0,
                    microbatch_size=p.microbatch_size or 0, zero_stage=self.precision.zero_stage,
                    precision=PRECISIONS.index(self.precision.precision), check_batches=int(self.check_batches),
                    num_model_chunks=p.num_model_chunks, pp_schedule_costs=int(p.measured_costs),
                    scheduler_nodes=fingerprint(p.nodes),
                    sequence_parallelism_mode=(None, *SEQUENCE_PARALLEL_MODES).index(self.sharding.sp_mode),
                    sp_size=self.sharding.sp_size)
