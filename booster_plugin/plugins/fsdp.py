"""GeminiPlugin and TorchFSDPPlugin: ColossalAI 0.5's fully sharded data-parallel plugins, both on torch's FSDP2
(`torch.distributed.fsdp.fully_shard`), with ColossalAI's constructor arguments.

Every parameter, gradient and optimizer state is sharded on dim 0 over the data-parallel ranks (the world; HSDP with
GeminiPlugin(extra_dp_size=n) or TorchFSDPPlugin(sharding_strategy=HYBRID_SHARD / NO_SHARD)). `boost` broadcasts rank
0's model, applies `fully_shard` to each decoder layer (the classes the model's `_no_split_modules` names, else our
shardformer policy's layer list) and then to the root, and points the optimizer at the sharded parameters. Each
backward reduce-scatters the gradients (averaged over data parallel), so a step equals one process on the global
batch. Checkpoints: checkpoint/fsdp_io.py (Hugging Face model files, safetensors + JSON optimizer state).
"""
from __future__ import annotations

from typing import Callable, ContextManager, Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, CPUOffloadPolicy, MixedPrecision,
                                    MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy)
from torch.utils.data import DataLoader

from ..checkpoint.ddp_io import ddp_context
from ..compat.colossal_args import Unacted
from ..checkpoint.fsdp_io import FSDPCheckpointIO
from ..compat.fsdp_args import (FSDP1_UNACTED, GEMINI_UNACTED, ShardLayout, fsdp1_layout, fsdp1_mp_policy,
                        refuse_fsdp1_options, warn_unacted)
from ..core.mixed_precision import DynamicLossScaler, LossScalerConfig
from ..fsdp.model import FSDPModel, GeminiModel
from ..core.optimizer_wrapper import OptimizerWrapper
from ..fsdp.optimizer import FSDPOptimizerWrapper, GeminiOptimizer
from ..fsdp.shard import (decoder_layers, make_mesh, parameter_names, policy_targets, prepare_replicas,
                         rebind_optimizer, shard_model)
from ..guards.launch import DEFAULT_TIMEOUT_S, default_device, ensure_distributed
from ..core.regional_compile import compile_layers
from ..guards.optimizer_guard import guard_parameters
from .base import DPPluginBase
from .speed import COLOSSALAI_SPEED_SWITCHES, SpeedConfig, use_kernels

__all__ = ["FSDPPluginBase", "GeminiPlugin", "TorchFSDPPlugin"]

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class FSDPPluginBase(DPPluginBase):
    """What both FSDP2 plugins share: the mesh, `configure` (module docstring), checkpoints, and the data-parallel
    group (the world) that prepare_dataloader splits the data over. Subclasses set the policies and wrap the
    optimizer."""

    model_class = FSDPModel  # what boost returns the sharded model in

    def __init__(self, layout: ShardLayout, mp_policy: MixedPrecisionPolicy,
                 root_mp_policy: Optional[MixedPrecisionPolicy] = None, offload_policy: Optional[OffloadPolicy] = None,
                 wrap_policy: Optional[Callable] = None, speed: Optional[SpeedConfig] = None) -> None:
        self.device = default_device()
        self.speed = speed if speed is not None else SpeedConfig(False, None, None)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if layout.replicate * layout.shard != self.world_size:
            raise ValueError(f"{type(self).__name__}: {layout.replicate} replicas x {layout.shard} shards do not "
                             f"make the world of {self.world_size} ranks.")
        self.layout = layout
        self.mp_policy, self.root_mp_policy = mp_policy, root_mp_policy or mp_policy
        self.offload_policy, self.wrap_policy = offload_policy, wrap_policy
        self.mesh = make_mesh(layout, self.device)

    def support_no_sync(self) -> bool:
        return False

    def support_lora(self) -> bool:
        return False

    def control_precision(self) -> bool:
        return True

    def configure(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                  criterion: Optional[Callable] = None, dataloader: Optional[DataLoader] = None, lr_scheduler=None):
        """The model sharded (module docstring) in an FSDPModel, the optimizer wrapped over its sharded parameters
        (the same torch optimizer object: an lr scheduler built on it stays valid)."""
        if isinstance(model, FSDPModel):
            raise ValueError("The model is already boosted (an FSDPModel): boost the original model once.")
        names = parameter_names(model)
        model = prepare_replicas(model, self.device)
        use_kernels(model, self.speed, self.device)
        layers = policy_targets(model, self.wrap_policy) if self.wrap_policy is not None else decoder_layers(model)
        shard_model(model, layers, self.mesh, self.layout, self.mp_policy, self.root_mp_policy, self.offload_policy)
        if self.speed.compile_layers:  # after fully_shard: its hooks stay at the compiled layers' boundaries
            compile_layers(layers)
        boosted = self.model_class(model)
        guard_parameters(model)  # an optimizer that skips boost is refused at its step, as HybridParallelPlugin's
        if optimizer is not None and not isinstance(optimizer, FSDPOptimizerWrapper):
            rebind_optimizer(optimizer, names, model)
            optimizer = self._wrap_optimizer(optimizer, boosted)
        return boosted, optimizer, criterion, dataloader, lr_scheduler

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: FSDPModel) -> FSDPOptimizerWrapper:
        return FSDPOptimizerWrapper(optimizer, model)

    def get_checkpoint_io(self) -> FSDPCheckpointIO:
        return FSDPCheckpointIO(ddp_context(self.device, DEFAULT_TIMEOUT_S))

    def no_sync(self, model: Optional[nn.Module] = None,
                optimizer: Optional[OptimizerWrapper] = None) -> ContextManager[None]:
        raise NotImplementedError(f"{type(self).__name__} does not support no_sync (as in ColossalAI). Gradient "
                                  f"accumulation needs none: call booster.backward for each micro-batch, then "
                                  f"optimizer.step(); every backward reduces its gradients, and they add up.")


class GeminiPlugin(FSDPPluginBase):
    """ColossalAI's GeminiPlugin (ZeRO-3 with chunk placement), every argument by name, on FSDP2.

    Implemented:
        precision: "fp32" (default; **ColossalAI's default is "fp16"**, and it offers no fp32: ours is fp32 so that
            results equal one process), "bf16" or "fp16": layers compute in that dtype, the sharded parameters stay
            fp32 (master weights; the optimizer steps them), gradients are reduced in fp32. fp16 scales the loss
            (dynamic loss scaler: initial_scale, min_scale, growth_factor, backoff_factor, growth_interval,
            hysteresis, max_scale, with ColossalAI's defaults); an overflow on any rank skips the step.
        master_weights: True; False with bf16/fp16 is refused (updates rounded to half precision change results).
        force_outputs_fp32: the model's floating outputs are cast to fp32.
        max_norm: clip the global gradient norm (0: off; `optimizer.get_grad_norm()` is the last norm);
            norm_type: 2.0 only, as ColossalAI's.
        extra_dp_size: HSDP, parameters sharded over world / extra_dp_size ranks and replicated extra_dp_size times.
        shard_param_frac: 0.0 keeps each layer's gathered parameters from its forward to its backward (ZeRO-2's
            memory); any other value frees them after the forward (ZeRO-3). A value in between warns.
        enable_gradient_accumulation: either value; gradients always add up over backward passes until the step
            (Gemini needs True for that). The step clears them, as Gemini's does.
        tp_size: 1 only (tensor parallelism inside Gemini is refused: use HybridParallelPlugin(tp_size=...)).
        enable_jit_fused, enable_fused_normalization, enable_flash_attention, enable_all_optimization: act as in
            HybridParallelPlugin (plugins/speed.py): decoder layers compiled after fully_shard, Liger's norms (CUDA)
            and the attention implementation set before it.
    Accepted, speed or memory only (a non-default value warns on rank 0): fsdp_args.GEMINI_UNACTED (chunk
    configuration and placement, offload fractions, fp8).
    """

    model_class = GeminiModel  # state_dict(only_rank_0=...) as ColossalAI's GeminiDDP

    def __init__(self, chunk_config_dict: Optional[dict] = None, chunk_init_device: Optional[torch.device] = None,
                 placement_policy: str = "static", enable_gradient_accumulation: bool = False, max_prefetch: int = 0,
                 shard_param_frac: float = 1.0, offload_optim_frac: float = 0.0, offload_param_frac: float = 0.0,
                 warmup_non_model_data_ratio: float = 0.8, steady_cuda_cap_ratio: float = 0.9,
                 precision: str = "fp32", master_weights: bool = True, pin_memory: bool = False,
                 force_outputs_fp32: bool = False, strict_ddp_mode: bool = False, search_range_m: int = 32,
                 hidden_dim: Optional[int] = None, min_chunk_size_m: float = 32, memstats: object = None,
                 gpu_margin_mem_ratio: float = 0.0, initial_scale: float = 2 ** 16, min_scale: float = 1,
                 growth_factor: float = 2, backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2, max_scale: float = 2 ** 32, max_norm: float = 0.0, norm_type: float = 2.0,
                 tp_size: int = 1, extra_dp_size: int = 1, enable_all_optimization: bool = False,
                 enable_fused_normalization: bool = False, enable_flash_attention: bool = False,
                 enable_sequence_parallelism: bool = False, enable_jit_fused: bool = False,
                 enable_async_reduce: bool = True, use_fp8: bool = False, verbose: bool = False,
                 fp8_communication: bool = False) -> None:
        unacted = {k: v for k, v in locals().items() if k in GEMINI_UNACTED}
        switches = {k: v for k, v in locals().items() if k in COLOSSALAI_SPEED_SWITCHES}
        dtype = _gemini_dtype(precision, master_weights, max_norm, norm_type, tp_size)
        scaler = LossScalerConfig(initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                                  min_scale, max_scale)
        if precision == "fp16":
            scaler.check()
        ensure_distributed()
        world = dist.get_world_size()
        if extra_dp_size < 1 or world % extra_dp_size:
            raise ValueError(f"extra_dp_size={extra_dp_size} must divide the world size {world}.")
        if 0.0 < shard_param_frac < 1.0:  # 0.0 and 1.0 are layouts we have (ZeRO-2 and ZeRO-3 memory)
            unacted["shard_param_frac"] = shard_param_frac
        warn_unacted("GeminiPlugin", {**GEMINI_UNACTED, "shard_param_frac": _PARTIAL_SHARD}, unacted)
        half = dtype is not None
        layer_mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if half else None)
        root_mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if half else None,
                                       output_dtype=torch.float32 if half and force_outputs_fp32 else None)
        speed = SpeedConfig.build(False, None, None, switches, default_device(), dist.get_rank())
        super().__init__(ShardLayout(extra_dp_size, world // extra_dp_size, shard_param_frac > 0), layer_mp, root_mp,
                         speed=speed)
        self.precision, self.max_norm, self.norm_type = precision, max_norm, norm_type
        self.scaler_config = scaler if precision == "fp16" else None
        self.tp_size, self.extra_dp_size, self.zero_size = tp_size, extra_dp_size, world // extra_dp_size

    def supported_precisions(self) -> List[str]:
        return list(_DTYPES)

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: FSDPModel) -> GeminiOptimizer:
        scaler = DynamicLossScaler(self.scaler_config, self.device) if self.scaler_config is not None else None
        return GeminiOptimizer(optimizer, model, scaler, self.max_norm)


def _gemini_dtype(precision: str, master_weights: bool, max_norm: float, norm_type: float,
                  tp_size: int) -> Optional[torch.dtype]:
    """The compute dtype (None: fp32); refuses, before any collective, what would change results."""
    if precision not in _DTYPES:
        raise ValueError(f"GeminiPlugin(precision={precision!r}): choose 'fp32', 'bf16' or 'fp16'.")
    if not master_weights and precision != "fp32":
        raise NotImplementedError(f"master_weights=False: {precision} training always keeps fp32 master weights "
                                  f"(without them updates round to {precision} and results change); use "
                                  f"master_weights=True.")
    if max_norm > 0 and norm_type != 2.0:
        raise NotImplementedError(f"norm_type={norm_type}: gradients are clipped by their 2-norm only (as in "
                                  f"ColossalAI's GeminiPlugin); use norm_type=2.0.")
    if tp_size != 1:
        raise NotImplementedError(f"GeminiPlugin(tp_size={tp_size}): tensor parallelism inside Gemini is not "
                                  f"supported; use HybridParallelPlugin(tp_size={tp_size}, zero_stage=1 or 2) for tp "
                                  f"with sharded optimizer states.")
    return _DTYPES[precision]


_PARTIAL_SHARD = Unacted(1.0, False, "keep that fraction of the parameters sharded (ours shards them all)")


class TorchFSDPPlugin(FSDPPluginBase):
    """ColossalAI's TorchFSDPPlugin (torch FSDP1's arguments) on FSDP2.

    Implemented:
        process_group: None or a group of the whole world (FSDP over a subgroup is refused).
        sharding_strategy: FULL_SHARD (default), SHARD_GRAD_OP (parameters kept gathered from forward to
            backward), NO_SHARD (replicated), HYBRID_SHARD / _HYBRID_SHARD_ZERO2 (sharded within a node of
            LOCAL_WORLD_SIZE ranks, replicated across nodes); all give the same results.
        cpu_offload: CPUOffload(offload_params=True) offloads the sharded parameters (FSDP2's CPUOffloadPolicy;
            nothing to do on CPU).
        auto_wrap_policy: which submodules get their own FSDP group (a torch wrap policy object, or a function
            `fn(module, recurse, nonwrapped_numel)` asked with recurse=False); default: each decoder layer.
        mixed_precision: MixedPrecision(param_dtype, reduce_dtype) as FSDP2's policy (the sharded parameters keep
            their dtype); keep_low_precision_grads=True and buffer_dtype are refused (FSDP2 cannot do them as FSDP1).
            As in ColossalAI, fp16 has no loss scaler here (use GeminiPlugin(precision="fp16")).
        sync_module_states: accepted; rank 0's model is always broadcast before sharding.
    Refused: ignored_modules (their replicas would drift apart), param_init_fn (initialize before boosting or use
    LazyInitContext). Accepted, speed only (warns): backward_prefetch, fp8_communication.
    """

    def __init__(self, process_group: Optional[ProcessGroup] = None,
                 sharding_strategy: Optional[ShardingStrategy] = None, cpu_offload: Optional[CPUOffload] = None,
                 auto_wrap_policy: Optional[Callable] = None, backward_prefetch: Optional[BackwardPrefetch] = None,
                 mixed_precision: Optional[MixedPrecision] = None,
                 ignored_modules: Optional[Iterable[nn.Module]] = None,
                 param_init_fn: Optional[Callable[[nn.Module], None]] = None, sync_module_states: bool = False,
                 fp8_communication: bool = False) -> None:
        refuse_fsdp1_options(ignored_modules, param_init_fn, cpu_offload)
        mp_policy = fsdp1_mp_policy(mixed_precision)
        ensure_distributed()
        world = dist.get_world_size()
        if process_group is not None and dist.get_world_size(process_group) != world:
            raise NotImplementedError(f"TorchFSDPPlugin(process_group=...) of {dist.get_world_size(process_group)} "
                                      f"ranks: FSDP over part of the world is not supported; pass None (the world).")
        warn_unacted("TorchFSDPPlugin", FSDP1_UNACTED, dict(backward_prefetch=backward_prefetch,
                                                             sync_module_states=sync_module_states,
                                                             fp8_communication=fp8_communication))
        offload = None
        if cpu_offload is not None and cpu_offload.offload_params and default_device().type != "cpu":
            offload = CPUOffloadPolicy()
        super().__init__(fsdp1_layout(sharding_strategy, world), mp_policy, offload_policy=offload,
                         wrap_policy=auto_wrap_policy)
        self.fp8_communication = fp8_communication

    def supported_precisions(self) -> List[str]:
        return ["fp16", "bf16"]
