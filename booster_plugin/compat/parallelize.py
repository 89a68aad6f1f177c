"""Paddle-style `parallelize(model, optimizer, mesh, config)`: the plan becomes a Policy, the mesh and configs a
HybridParallelPlugin, and the model is boosted by the same mechanism as `Booster.boost`.

    model, optimizer = parallelize(model, optimizer, mesh={"dp": 1, "pp": 2, "mp": 2}, config={
        "mp_config": {"parallelize_plan": {"model.embed_tokens": RowWiseParallel(),
                                           "model.layers.*.self_attn.q_proj": ColWiseParallel(), ...,
                                           "lm_head.weight": ColWiseParallel()}},
        "pp_config": {"split_spec": "model.layers", "accumulate_steps": 4}})
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

Under pipeline parallelism a training-mode call runs the whole 1F1B step (forward and backward over the
microbatches): the returned loss is the step's mean loss, and its `backward()` has nothing left to do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from pipeline import ProcessGroupMesh
from pipeline.step import MicroBatch
from shardformer.tensor.styles import ParallelStyle
from shardformer.policies.from_paddle import PaddlePlanPolicy, resolve_plan, resolve_split

from ..booster import Booster
from ..core.optimizer import HybridParallelOptimizer
from ..guards.launch import ensure_distributed
from ..plugins.hybrid import HybridParallelPlugin

_CONFIG_KEYS = {"dp_config": {"sharding_level"}, "mp_config": {"parallelize_plan", "divide_attributes"},
                "pp_config": {"split_spec", "accumulate_steps", "global_spec"}}
_HEAD_COUNTS = ("num_heads", "n_heads", "num_attention_heads", "n_head")


@dataclass
class PipelineStepOutput:
    """What a call of a pipelined model returns: the step's loss (in training already back-propagated; None
    without labels) and, in evaluation, the merged outputs on the last stage (None elsewhere)."""
    loss: Optional[torch.Tensor]
    outputs: Any = None


class ParallelizedModel(nn.Module):
    """The parallelized model: call it like the original.

    Args:
        boosted: the boosted model (`HybridParallelModule`).
        booster: the Booster that boosted it (for `save_model` / `load_model` and the pipeline).
    """

    def __init__(self, boosted: nn.Module, booster: Booster) -> None:
        super().__init__()
        self.boosted = boosted
        self.booster = booster
        self.optimizer = None

    def forward(self, **batch: Any) -> Any:
        if self.booster.plugin.pp_size == 1:
            return self.boosted(**batch)
        train = self.training and torch.is_grad_enabled()
        if train and self.optimizer is None:
            raise ValueError("Training with a pipeline needs the optimizer: pass it to parallelize().")
        criterion = _own_loss if train or "labels" in batch else None
        out = self.booster.execute_pipeline(iter([batch]), self.boosted, criterion, self.optimizer if train else None,
                                            return_loss=criterion is not None, return_outputs=not train)
        if train:  # backward ran inside the step: a leaf, so that the caller's loss.backward() is a no-op
            return PipelineStepOutput(out["loss"].detach().requires_grad_())
        return PipelineStepOutput(out["loss"], out["outputs"])

    def unwrap(self) -> nn.Module:
        return self.boosted.unwrap()


def _own_loss(outputs: Any, batch: MicroBatch) -> torch.Tensor:
    if getattr(outputs, "loss", None) is None:
        raise ValueError("parallelize() with a pipeline trains with the model's own loss: give it `labels`.")
    return outputs.loss


def _sizes(mesh: Union[None, ProcessGroupMesh, Mapping[str, int]]) -> Tuple[int, int, int]:
    """(dp, pp, tp) from a ProcessGroupMesh (dp, pp, tp) or sizes {"dp", "pp", "mp"}; None: all data parallel."""
    world = dist.get_world_size()
    if mesh is None:
        return world, 1, 1
    if isinstance(mesh, ProcessGroupMesh):
        if len(mesh.shape) != 3:
            raise ValueError(f"A ProcessGroupMesh for parallelize() has axes (dp, pp, tp); got shape {mesh.shape}.")
        return tuple(mesh.shape)
    unknown = set(mesh) - {"dp", "pp", "mp"}
    if unknown:
        raise ValueError(f"mesh sizes take the axes 'dp', 'pp', 'mp'; got {sorted(unknown)}.")
    pp, tp = mesh.get("pp", 1), mesh.get("mp", 1)
    dp = mesh.get("dp", world // (pp * tp))
    if dp * pp * tp != world:
        raise ValueError(f"mesh {dict(mesh)} needs {dp * pp * tp} processes; the world has {world}.")
    return dp, pp, tp


def _check_config(config: Mapping[str, Any]) -> None:
    for key, value in config.items():
        if key not in _CONFIG_KEYS:
            raise ValueError(f"config[{key!r}] is not supported; use {sorted(_CONFIG_KEYS)}.")
        unknown = set(value) - _CONFIG_KEYS[key]
        if unknown:
            raise ValueError(f"config[{key!r}] does not support {sorted(unknown)}; use {sorted(_CONFIG_KEYS[key])}.")


def _refuse_undivided_heads(model: nn.Module, policy: PaddlePlanPolicy, styles: Mapping[str, ParallelStyle],
                            tp: int) -> None:
    """Without a built-in policy nothing says which attention attributes count heads: ask rather than guess."""
    if tp == 1 or policy.known is not None or policy.tp_attributes:
        return
    for path, module in model.named_modules():
        counts = [a for a in _HEAD_COUNTS if isinstance(getattr(module, a, None), int)]
        if counts and any(p.startswith(path + ".") for p in styles):
            raise ValueError(f"{type(model).__name__} has no built-in policy and {path} keeps a head count "
                             f"({', '.join(counts)}): say whether tp divides it, e.g. mp_config['divide_attributes'] "
                             f"= {{'<base-relative pattern of {path}>': ({counts[0]!r},)}}.")


def parallelize(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                mesh: Union[None, ProcessGroupMesh, Mapping[str, int]] = None,
                config: Optional[Mapping[str, Any]] = None
                ) -> Tuple[ParallelizedModel, Optional[HybridParallelOptimizer]]:
    """Parallelize a model (and its optimizer) as Paddle's `dist.parallelize` does.

    Args:
        model: the unsharded transformers model (every rank builds the same one).
        optimizer: an optimizer over `model.parameters()`, or None.
        mesh: a `ProcessGroupMesh(dp, pp, tp)`, sizes {"dp": .., "pp": .., "mp": ..} (dp defaults to the rest of
            the world), or None (every rank data parallel).
        config: {"dp_config": {"sharding_level": 0 | 1 | 2}, "mp_config": {"parallelize_plan": {pattern: plan},
            "divide_attributes": {pattern: (attr,)}}, "pp_config": {"split_spec": "model.layers" |
            {name: SplitPoint.END}, "accumulate_steps": microbatches (default pp)}}.

    Returns:
        (the parallelized model, the wrapped optimizer or None).
    """
    config = dict(config or {})
    _check_config(config)
    ensure_distributed()
    dp, pp, tp = _sizes(mesh)
    level = config.get("dp_config", {}).get("sharding_level", 0)
    if level not in (0, 1, 2):
        raise NotImplementedError(f"dp_config sharding_level={level} is not supported; use 0 (plain data parallel), "
                                  f"1 or 2 (ZeRO stage 1 / 2: optimizer state, and gradients, partitioned over dp).")
    mp_config, pp_config = config.get("mp_config", {}), config.get("pp_config", {})
    styles = resolve_plan(model, mp_config.get("parallelize_plan", {}))
    layers, per_stage = "", None
    if pp > 1:
        if "split_spec" not in pp_config:
            raise ValueError(f"mesh has pp={pp}: give pp_config={{'split_spec': '<layer list>'}}.")
        layers, per_stage = resolve_split(model, pp_config["split_spec"], pp)
    global_spec = pp_config.get("global_spec")
    if global_spec is not None and any(True for _ in model.get_submodule(global_spec).parameters()):
        raise NotImplementedError(f"global_spec={global_spec!r} has parameters; only parameter-free modules (which "
                                  f"run on every stage anyway) may be global.")
    policy = PaddlePlanPolicy(model, styles, layers, mp_config.get("divide_attributes"))
    _refuse_undivided_heads(model, policy, styles, tp)
    microbatches = pp_config.get("accumulate_steps", pp) if pp > 1 else None
    plugin = HybridParallelPlugin(tp_size=tp, pp_size=pp, num_microbatches=microbatches, zero_stage=level,
                                  custom_policy=policy, num_layers_per_stage=per_stage)
    if dp != plugin.dp_size:
        raise ValueError(f"mesh dp={dp} but the world leaves dp={plugin.dp_size}.")
    booster = Booster(plugin=plugin)
    boosted, boosted_optimizer, *_ = booster.boost(model, optimizer)
    parallel = ParallelizedModel(boosted, booster)
    parallel.optimizer = boosted_optimizer
    return parallel, boosted_optimizer
