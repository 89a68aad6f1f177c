"""The proof of a policy (policies/proven.py): before the real model is sharded, a small twin of it (twin.py) runs one
forward and backward sharded with the policy, under the job's own tp group and pipeline layout, and whole on every
rank. The policy is refused unless the two agree (fp32, 1e-5): the loss, the output of every layer, entry and exit
module, row-parallel module and (not vocab-split) head, and every gradient (gathered over tp; tied weights summed over
the stages holding them). The refusal names the first mismatch: a sharded forward or backward that fails names the
module it failed in; else the first module, in forward order, whose output differs; else the first parameter, in model
order, whose gradient differs. Every rank reaches the same verdict (gathered over tp, then over pp) before any
collective of the real model.

Cost: a twin of one layer per virtual stage (at least two) with a few heads per tp rank and 8-dim heads (about 30k
parameters for OPT, BLOOM or GPT-J), built, copied and sharded on every rank; one forward and backward of a 2 x 8 batch
whole and sharded, the pipeline hops between stages, two all-gathers of the verdict. Verdicts are remembered per
process, by model class, config, plan and layout. The twin has no dropout and runs in fp32 whatever the job's
precision (the plan is proven, not the precision); sequence and expert parallelism are left out (they have their own
checks); the job's RNG is left as it was. The comparison mirrors hp_check's (its checker drives the plugin from
above the library, so it is not imported here).
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from pipeline.context import Axis

from ..layer.spec import gather_tensor, get_tp_spec
from ..paths import base_prefix, match
from ..policies.from_transformers import PlanRefused
from ..sharder import ShardResult, Sharder
from ..stage.forward import Released, ZeroEmbedding
from ..tensor.styles import Rowwise, VocabHead
from .twin import build_twin, synthetic_batch

__all__ = ["prove_policy", "TOL"]

logger = logging.getLogger("shardformer")
TOL = 1e-5
_VERDICTS: Dict[str, Optional[str]] = {}   # per process: proof key -> refusal (None: proven)
Mismatch = Tuple[int, int, str]            # (phase, order, message): the smallest is reported


def prove_policy(policy) -> None:
    """Prove `policy` (bound to its model, shard config and stage manager) on a twin of its model; PlanRefused,
    on every rank alike, if it is not exact. Nothing to prove without tp or pp."""
    cfg, sm = policy.shard_config, policy.stage_manager
    tp = cfg.tp_size if cfg is not None else 1
    if tp == 1 and sm is None:
        return
    model = policy.model
    layout = None if sm is None else (sm.num_stages, sm.num_model_chunks, tuple(sm.layout))
    key = repr((type(model).__name__, type(policy).__name__, policy.layers, policy.entry, policy.exit,
                sorted(policy.tp_plan.items()), sorted(policy.head_tp_plan.items()), policy.tp_attributes,
                model.config.to_json_string(), tp, layout, cfg.parallel_output, cfg.make_vocab_size_divisible_by))
    if key not in _VERDICTS:
        start = time.perf_counter()
        _VERDICTS[key] = _prove(policy, cfg, sm)
        if _VERDICTS[key] is None and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.info(f"{type(model).__name__}: {policy.source} policy {type(policy).__name__} proved exact on a "
                        f"twin at tp={tp}, pp={sm.num_stages if sm else 1} in {time.perf_counter() - start:.2f} s.")
    if _VERDICTS[key] is not None:
        raise PlanRefused(_VERDICTS[key])


def _prove(policy, cfg, sm) -> Optional[str]:
    model = policy.model
    tp, stages = cfg.tp_size, (sm.layout.num_stages if sm is not None else 1)
    what = (f"{type(model).__name__}: the {policy.source} policy {type(policy).__name__} is refused: one forward "
            f"and backward of a small twin of the model, sharded with it at tp={tp}, pp="
            f"{sm.num_stages if sm else 1}, differs from the unsharded twin")
    device = _device(cfg, sm)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            twin = build_twin(model, tp, max(2, stages)).to(device)
        except Exception as error:  # noqa: BLE001  (a config this shrinking does not fit: alike on every rank)
            refused = what.split(": one forward")[0]
            return f"{refused}: no small twin of the model can be built to prove it ({_say(error)})."
        reference = copy.deepcopy(twin)
        batch = synthetic_batch(twin, device=device)
        twin_policy = policy.twin_policy()
        points = _checkpoints(reference, twin_policy)
        ref = _Recorder(reference, points)
        try:
            ref_loss = _loss(reference(**batch))
            ref_loss.backward()
        except Exception as error:  # noqa: BLE001  (alike on every rank: no collective yet)
            return f"{what}: the unsharded twin itself fails ({_say(error)}); it cannot be proven."
        shard_cfg = replace(cfg, pipeline_stage_manager=_twin_stage_manager(sm), rng_tracker=None,
                            sequence=None, ep=Axis.alone("ep"),
                            chunked_loss=False)  # the plan's logits are compared
        sharder = Sharder(twin, twin_policy, shard_cfg)
        try:
            sharded = sharder.shard()
        except Exception as error:  # noqa: BLE001  (sharding is local: alike on every rank)
            return f"{what}: sharding the twin fails ({_say(error)})."
        found = _run_and_compare(twin, sharded, sm, batch, ref, ref_loss, cfg, device)
    return None if found is None else f"{what}: {found[2]}. Write a policy for it (custom_policy=...)."


def _device(cfg, sm) -> torch.device:
    """Where the twin runs: the accelerator where the groups communicate on it (NCCL), else the CPU."""
    groups = [g for g in (cfg.tp.active, sm.pp_group if sm is not None else None) if g]
    if torch.cuda.is_available() and any(dist.get_backend(g) == "nccl" for g in groups):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _twin_stage_manager(sm):
    """The job's stage manager for the twin's layers: the same layout, layers split evenly."""
    if sm is None:
        return None
    twin = copy.copy(sm)
    twin.num_layers_per_stage = None
    twin._stage_indices = None
    return twin


def _say(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:300]}"


def _loss(output) -> torch.Tensor:
    """The model's own loss where it computes one, else a function of its first output (no head: hidden states)."""
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    return _first_tensor(output).float().sin().mean()


def _first_tensor(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output
    return next(v for v in values if isinstance(v, torch.Tensor))


def _checkpoints(model: nn.Module, policy) -> List[str]:
    """Model paths whose output is whole on every tp rank: layers, entry / exit modules, row-parallel modules and
    heads that are not vocab-split."""
    prefix, found = base_prefix(model), []
    for path, _ in model.named_modules():
        rel = path[len(prefix):] if path.startswith(prefix) else None
        style = next((s for p, s in policy.tp_plan.items() if rel is not None and match(p, rel)), None)
        if rel is not None and (match(policy.layers + ".*", rel) or rel in policy.entry or rel in policy.exit
                                or isinstance(style, Rowwise)):
            found.append(path)
        elif rel is None and path and "." not in path and not any(  # (a head holding a vocab-split layer: split)
                isinstance(s, VocabHead) and (p == path or p.startswith(path + "."))
                for p, s in policy.head_tp_plan.items()):
            found.append(path)
    return found


class _Recorder:
    """Forward hooks recording the outputs of `points` (first call each, in call order) and the stack of modules
    running (the innermost names where a forward failed); hooks on modules matching `first` run before others."""

    def __init__(self, model: nn.Module, points: List[str], first: Tuple[str, ...] = ()) -> None:
        self.outputs: Dict[str, torch.Tensor] = {}
        self.order: List[str] = []
        self.stack: List[str] = []
        self.model_params = dict(model.named_parameters(remove_duplicate=False))
        wanted = set(points)
        for path, module in model.named_modules():
            own = path in wanted and not isinstance(module, (ZeroEmbedding, nn.Identity, Released))  # (stand-ins)
            module.register_forward_pre_hook(lambda m, a, p=path: self.stack.append(p), prepend=True)
            # after the module's other hooks (e.g. an in-place vocab split's sum), except on layers, where a
            # pipeline stage's exit hook ends the forward
            module.register_forward_hook(lambda m, a, o, p=path, r=own: self._done(p, o, r),
                                         prepend=any(match(f, path) for f in first))

    def _done(self, path: str, output, record: bool) -> None:
        if self.stack and self.stack[-1] == path:
            self.stack.pop()
        if record and path not in self.outputs:
            try:
                self.outputs[path] = _first_tensor(output).detach().clone()
                self.order.append(path)
            except StopIteration:
                pass


def _differs(actual: Optional[torch.Tensor], expected: torch.Tensor) -> Optional[str]:
    """None when close (rtol = atol = TOL), else how they differ."""
    if actual is None:
        return "it is missing"
    if actual.shape != expected.shape:
        return f"its shape is {tuple(actual.shape)} instead of {tuple(expected.shape)}"
    if torch.allclose(actual.float(), expected.float(), rtol=TOL, atol=TOL):
        return None
    return f"it differs by {float((actual.float() - expected.float()).abs().max()):.3g} (max abs)"


def _agree(item: Optional[Mismatch], groups) -> Optional[Mismatch]:
    """The smallest mismatch of every rank of `groups` (applied in turn: tp, then pp), on each of them."""
    for group in groups:
        if group is None or dist.get_world_size(group) == 1:
            continue
        everyone: List[Optional[Mismatch]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, item, group=group)
        found = sorted(x for x in everyone if x is not None)
        item = found[0] if found else None
    return item


def _run_and_compare(twin, sharded: ShardResult, sm, batch, ref: "_Recorder", ref_loss, cfg,
                     device) -> Optional[Mismatch]:
    """The sharded twin's forward, then (if it agrees) backward, each compared with the reference's."""
    groups = (cfg.tp.active, sm.pp_group if sm is not None else None)
    rec = _Recorder(twin, list(ref.outputs), (base_prefix(twin) + sharded.plan.layers + ".*",))
    pipe = _Pipeline(twin, sharded.stage_forward, sm, device)
    found = pipe.forward(batch, rec)
    order = {p: i for i, p in enumerate(ref.order)}
    for path, output in rec.outputs.items() if found is None else ():
        how = _differs(output, ref.outputs[path])
        if how is not None:
            found = min(found or (9, 0, ""), (1, order[path], f"the output of '{path}' {_role(path, ref.order)} "
                                                              f"differs first: {how}"))
    if found is None and pipe.loss is not None and _differs(pipe.loss.detach(), ref_loss.detach()):
        found = (1, len(order), f"the loss {float(pipe.loss):.6g} differs from {float(ref_loss):.6g}")
    found = _agree(found, groups)
    if found is not None:
        return found
    found = pipe.backward(rec)
    found = _agree(found, groups)
    if found is not None:
        return found
    pipe.sum_shared(sharded.shared)
    return _agree(_grad_mismatch(twin, ref, cfg.tp.active), groups)


def _role(path: str, order: List[str]) -> str:
    return f"(module {order.index(path) + 1} of {len(order)} compared, in forward order)"


def _grad_mismatch(twin: nn.Module, ref: "_Recorder", group) -> Optional[Mismatch]:
    """The first parameter (model order) of this rank whose full gradient differs from the reference's; collective
    over tp (every rank of a stage gathers the same parameters in the same order)."""
    reference = ref.model_params
    order = {n: i for i, n in enumerate(reference)}
    found = None
    for name, p in twin.named_parameters():
        grad = p.grad
        spec = get_tp_spec(p)
        if grad is not None and spec is not None and group is not None:
            grad = gather_tensor(grad, spec, group)
        want = reference[name].grad
        if want is None:  # unused by the loss (e.g. a pooler): no gradient, or zeros, here either
            how = "it is unexpected" if grad is not None and grad.abs().max() > 0 else None
        else:
            how = _differs(grad, want)
        if how is not None and found is None:
            module = name.rpartition(".")[0]
            found = (3, order[name], f"the gradient of '{name}' (module '{module}') differs first: {how}")
    return found


_HEADER = 8  # [ok, ndim, sizes...]


def _send(tensor: Optional[torch.Tensor], dst: int, group, device: torch.device) -> None:
    """A header (is there a tensor, its shape), then the tensor (fp32): None tells the peer this rank failed."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    if tensor is not None:
        header[0], header[1] = 1, tensor.dim()
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
    dist.send(header.to(device), dst, group=group)
    if tensor is not None:
        dist.send(tensor.detach().float().contiguous(), dst, group=group)


def _recv(src: int, group, device: torch.device) -> Optional[torch.Tensor]:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    header = header.cpu()
    if not int(header[0]):
        return None
    tensor = torch.empty(header[2:2 + int(header[1])].tolist(), dtype=torch.float32, device=device)
    dist.recv(tensor, src, group=group)
    return tensor


class _Pipeline:
    """One batch through this rank's virtual stages in order (the pipeline's own stage calls, one microbatch), the
    hidden states and, backward, their gradients sent between stages behind a header that says whether the sender
    failed: a failing stage never leaves a peer waiting."""

    def __init__(self, model: nn.Module, stage_forward, sm, device: torch.device) -> None:
        self.model, self.stage_forward, self.sm, self.device = model, stage_forward, sm, device
        self.mine = [0] if sm is None else sorted(sm.layout.stages_of(sm.stage))
        self.last = 0 if sm is None else sm.layout.num_stages - 1
        self.inputs: Dict[int, Optional[torch.Tensor]] = {}
        self.outputs: Dict[int, Optional[torch.Tensor]] = {}
        self.grads: Dict[int, Optional[torch.Tensor]] = {}
        self.loss: Optional[torch.Tensor] = None
        self.failed: Optional[Mismatch] = None

    def _local(self, v: int) -> bool:
        return self.sm is None or self.sm.layout.rank_of(v) == self.sm.stage

    def _peer(self, v: int) -> int:
        return self.sm.stage_ranks[self.sm.layout.rank_of(v)]

    def _take(self, v: int, local: Dict[int, Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
        return local.get(v) if self._local(v) else _recv(self._peer(v), self.sm.pp_group, self.device)

    def _give(self, v: int, tensor: Optional[torch.Tensor]) -> None:
        if not self._local(v):
            _send(tensor, self._peer(v), self.sm.pp_group, self.device)

    def forward(self, batch: Dict[str, torch.Tensor], rec: "_Recorder") -> Optional[Mismatch]:
        for v in self.mine:
            x = self._take(v - 1, self.outputs) if v > 0 else None
            out = None
            if self.failed is None and (v == 0 or x is not None):
                x = x.detach().requires_grad_() if x is not None else None
                rec.stack.clear()
                try:
                    result = self.model(**batch) if self.stage_forward is None else \
                        self.stage_forward(hidden_states=x, pipeline_chunk=self.mine.index(v), **batch)
                    out = _loss(result) if v == self.last else result["hidden_states"]
                except Exception as error:  # noqa: BLE001
                    where = f"in '{rec.stack[-1]}'" if rec.stack else "at the top"
                    self.failed = (0, v, f"the sharded forward of stage {v} fails {where} ({_say(error)})")
            self.inputs[v], self.outputs[v] = x, out
            if v == self.last:
                self.loss = out
            else:
                self._give(v + 1, out)
        return self.failed

    def backward(self, rec: "_Recorder") -> Optional[Mismatch]:
        for v in reversed(self.mine):
            grad = self._take(v + 1, self.grads) if v < self.last else None
            x, g = self.inputs[v], None
            if self.failed is None and (v == self.last or grad is not None):
                try:
                    self.outputs[v].backward(grad)
                    g = torch.zeros_like(x) if x is not None and x.grad is None else (x.grad if x is not None else None)
                except Exception as error:  # noqa: BLE001
                    self.failed = (2, -v, f"the sharded backward of stage {v} fails ({_say(error)})")
            self.grads[v] = g
            if v > 0:
                self._give(v - 1, g)
        return self.failed

    def sum_shared(self, shared: List[Dict[int, str]]) -> None:
        """Gradients of a weight held by several stages (tied embeddings) summed over them, as the plugin does."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        me = None if self.sm is None else self.sm.stage
        for names in shared:
            if me not in names:
                continue
            p = params[names[me]]
            own, total = p.grad, p.grad
            for other in sorted(names):
                if other == me:
                    continue
                dst = self.sm.stage_ranks[other]
                if me < other:
                    _send(own, dst, self.sm.pp_group, self.device)
                    got = _recv(dst, self.sm.pp_group, self.device)
                else:
                    got = _recv(dst, self.sm.pp_group, self.device)
                    _send(own, dst, self.sm.pp_group, self.device)
                total = got if total is None else total if got is None else total + got
            p.grad = total
