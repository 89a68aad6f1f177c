"""HybridParallelPlugin: dp × pp × tp over the world, with ColossalAI's argument names."""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from pipeline.trace import ScheduleTracer
from pipeline import PipelineP2PCommunication, PipelineSchedule, PipelineStageManager, ProcessGroupMesh
from pipeline.schedules import layout_for, make_schedule
from shardformer.policies import Policy, get_autopolicy
from shardformer.sharder import ShardConfig, Sharder

from .parallel_module import HybridParallelModule, HybridParallelOptimizer

DP_AXIS, PP_AXIS, TP_AXIS = 0, 1, 2
_SUPPORTED_PRECISIONS = ("fp32", "bf16")


def default_device() -> torch.device:
    """This rank's accelerator when there is one (by LOCAL_RANK), else the CPU."""
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        index = int(os.environ.get("LOCAL_RANK", 0)) % torch.accelerator.device_count()
        torch.accelerator.set_device_index(index)
        return torch.device(acc.type, index)
    return torch.device("cpu")


def ensure_distributed() -> None:
    """Initialize torch.distributed from torchrun's environment unless the user already did (gloo/NCCL by device)."""
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"torch.distributed is not initialized and {', '.join(missing)} are not set: launch with "
                           f"`torchrun --nproc_per_node=N script.py` or call torch.distributed.init_process_group().")
    backend = "gloo"  # CPU; with an accelerator, its backend (NCCL on CUDA) plus gloo for CPU tensors
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator().type
        backend = f"cpu:gloo,{kind}:{dist.Backend.default_device_backend_map.get(kind, 'gloo')}"
    dist.init_process_group(backend)


class HybridParallelPlugin:
    """Tensor parallel inside each stage, pipeline across stages, data parallel over the rest of the world."""

    def __init__(self, tp_size: int = 1, pp_size: int = 1, num_microbatches: Optional[int] = None,
                 microbatch_size: Optional[int] = None, precision: str = "fp32", zero_stage: int = 0,
                 max_norm: float = 0.0, custom_policy: Optional[Policy] = None,
                 num_layers_per_stage: Optional[Sequence[int]] = None, pp_style: str = "1f1b",
                 num_model_chunks: int = 1, enable_sequence_parallelism: bool = False,
                 parallel_output: bool = True, make_vocab_size_divisible_by: int = 64,
                 enable_metadata_cache: bool = True, p2p_transport: str = "p2p", seed: int = 1024,
                 trace: Optional[bool] = None,
                 loss_weight_fn: Optional[Callable[[Dict[str, Any]], Any]] = None,
                 **unsupported: Any) -> None:
        # every check before the first collective, so that bad input fails the same way on every rank
        if unsupported:
            raise TypeError(f"HybridParallelPlugin does not support {sorted(unsupported)} yet.")
        if tp_size < 1 or pp_size < 1:
            raise ValueError(f"tp_size and pp_size must be >= 1, got tp_size={tp_size}, pp_size={pp_size}.")
        if precision not in _SUPPORTED_PRECISIONS:
            raise ValueError(f"precision={precision!r} is not supported; use one of {_SUPPORTED_PRECISIONS}.")
        if zero_stage != 0:
            raise NotImplementedError("zero_stage > 0 is not implemented; use zero_stage=0.")
        if isinstance(num_layers_per_stage, str) and num_layers_per_stage != "auto":
            raise ValueError(f"num_layers_per_stage must be a list, None or 'auto', got {num_layers_per_stage!r}.")
        layout = layout_for(pp_style, pp_size, num_model_chunks)  # pp_style "1f1b", "interleaved" or "zbv"
        if pp_style != "1f1b" and (pp_size == 1 or p2p_transport != "p2p"):
            raise ValueError(f"pp_style={pp_style!r} needs pp_size > 1 and p2p_transport='p2p'.")
        if enable_sequence_parallelism:
            raise NotImplementedError("Sequence parallelism is not implemented; use enable_sequence_parallelism=False.")
        if loss_weight_fn is not None and pp_size == 1 and not (num_microbatches or microbatch_size):
            raise ValueError("loss_weight_fn weighs the microbatches of execute_pipeline: also give num_microbatches "
                             "(or microbatch_size).")
        if pp_size > 1:
            if (num_microbatches is None) == (microbatch_size is None):
                raise ValueError("With pp_size > 1 give exactly one of num_microbatches or microbatch_size.")
            if num_microbatches is not None:
                make_schedule(pp_style, pp_size, num_model_chunks, num_microbatches)  # e.g. m < p: a clear error
        ensure_distributed()
        world = dist.get_world_size()
        if world % (tp_size * pp_size):
            raise ValueError(f"World size {world} is not divisible by tp_size * pp_size = {tp_size} * {pp_size}; "
                             f"launch a multiple of {tp_size * pp_size} processes or change the sizes.")
        self.tp_size, self.pp_size = tp_size, pp_size
        self.dp_size = world // (tp_size * pp_size)
        self.precision, self.max_norm, self.custom_policy = precision, max_norm, custom_policy
        self.parallel_output, self.make_vocab_size_divisible_by = parallel_output, make_vocab_size_divisible_by
        self.seed = seed
        self.device = default_device()

        self.pg_mesh = ProcessGroupMesh(self.dp_size, pp_size, tp_size)
        self.dp_group = self.pg_mesh.get_group_along_axis(DP_AXIS)
        self.tp_group = self.pg_mesh.get_group_along_axis(TP_AXIS)
        self.stage_manager = PipelineStageManager(self.pg_mesh, PP_AXIS, num_model_chunks=num_model_chunks,
                                                  num_layers_per_stage=num_layers_per_stage, layout_style=layout.style)
        self.pp_group = self.stage_manager.pp_group
        self.dp_rank = self.pg_mesh.coordinate[DP_AXIS]
        self.tp_rank = self.pg_mesh.coordinate[TP_AXIS]
        self.schedule = None
        if pp_size > 1 or num_microbatches or microbatch_size:
            p2p = PipelineP2PCommunication(self.stage_manager, self.device, transport=p2p_transport,
                                           enable_metadata_cache=enable_metadata_cache)
            self.schedule = PipelineSchedule(self.stage_manager, p2p, num_microbatches, microbatch_size, pp_style)
            if loss_weight_fn is not None:
                self.schedule.loss_scales_fn = self._token_weighted_scales(loss_weight_fn)
            if trace if trace is not None else os.environ.get("HP_TRACE", "0") not in ("", "0"):
                self.schedule.tracer = ScheduleTracer(self.stage_manager.stage, pp_size)

    def _token_weighted_scales(self, count: Callable[[Dict[str, Any]], Any]):
        """Weigh each microbatch's (mean) loss by its share of the loss items (e.g. label tokens) of the whole
        global batch, so that the step equals one process on the global batch even with padding."""

        def scales(microbatches):
            counts = torch.tensor([float(count(mb)) for mb in microbatches], dtype=torch.float64)
            total = counts.sum().reshape(1).to(self.device)
            local = float(total.item())
            if self.dp_size > 1:  # gradients are averaged over replicas: scale by dp / global count
                dist.all_reduce(total, group=self.dp_group)
            backward = (counts * self.dp_size / max(float(total.item()), 1.0)).tolist()
            report = (counts / max(local, 1.0)).tolist()  # this replica's token mean
            return backward, report

        return scales

    # -- boosting ---------------------------------------------------------------------------------------
    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        if isinstance(model, HybridParallelModule):
            raise ValueError("This model is already boosted.")
        param_names: Dict[int, list] = {}
        for name, p in model.named_parameters(remove_duplicate=False):  # a tied parameter has several names
            param_names.setdefault(id(p), []).append(name)
        policy = self.custom_policy if self.custom_policy is not None else get_autopolicy(model)
        # the unsharded layout (names, shapes, dtypes, holding stages), for checkpoints in HF format
        full_params = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}
        rng_tracker = None
        if self.tp_size > 1:
            from shardformer.layer.dropout import TPRNGTracker
            rng_tracker = TPRNGTracker(self.device)
            rng_tracker.sync(self.tp_group, self.seed + self.dp_rank)  # same masks across tp, not dp
        shard_config = ShardConfig(
            tensor_parallel_process_group=self.tp_group if self.tp_size > 1 else None,
            pipeline_stage_manager=self.stage_manager if self.pp_size > 1 else None,
            parallel_output=self.parallel_output, make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
            rng_tracker=rng_tracker)
        sharder = Sharder(model, policy, shard_config)
        shared_names = sharder.shard()
        if self.precision == "bf16":
            model.to(torch.bfloat16)
        sharder._materialize(self.device)  # lazy init: a model built on the meta device gets only this rank's shard
        model.to(self.device)

        params = dict(model.named_parameters(remove_duplicate=False))
        shared = []
        for names in shared_names:  # every rank creates every group, in the same order
            stages = sorted(names)
            group = self.pg_mesh.get_group_along_axis(PP_AXIS, indices=stages)
            if self.stage_manager.stage in names:
                shared.append((params[names[self.stage_manager.stage]], group, self.stage_manager.stage == stages[0]))
        module = HybridParallelModule(model, sharder.stage_forward, self.dp_group if self.dp_size > 1 else None,
                                      self.tp_group if self.tp_size > 1 else None,
                                      self.pp_group if self.pp_size > 1 else None, shared)
        module.policy, module.full_params = policy, full_params
        module.sync_params()
        if optimizer is not None:
            _rebind_optimizer(optimizer, param_names, params)
            optimizer = HybridParallelOptimizer(optimizer, module, self.max_norm,
                                                tracer=self.schedule.tracer if self.schedule else None,
                                                master_dtype=torch.float32 if self.precision != "fp32" else None)
        return module, optimizer, criterion, dataloader, lr_scheduler

    def execute_pipeline(self, data_iter: Iterator, model: HybridParallelModule, criterion: Callable,
                         optimizer: Optional[HybridParallelOptimizer] = None, return_loss: bool = True,
                         return_outputs: bool = False) -> Dict[str, Any]:
        if self.schedule is None:
            raise ValueError("execute_pipeline needs num_microbatches or microbatch_size in HybridParallelPlugin.")
        return self.schedule.forward_backward_step(model, data_iter, criterion, optimizer, return_loss, return_outputs)

    def write_trace(self, out_dir: str) -> Optional[Dict[str, float]]:
        """Collective: write the recorded schedule timeline (trace.json, timeline.png, bubble.json) from rank 0.

        Needs `trace=True` (or HP_TRACE=1); returns the bubble summary on rank 0."""
        tracer = self.schedule.tracer if self.schedule else None
        if tracer is None:
            raise ValueError("No trace was recorded: create the plugin with trace=True or set HP_TRACE=1.")
        return tracer.gather_and_write(out_dir)

    def prepare_dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = False, seed: int = 1024,
                           drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0,
                           **kwargs: Any) -> DataLoader:
        """A DataLoader over this rank's data-parallel shard: pp and tp ranks of one replica see the same batches."""
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
