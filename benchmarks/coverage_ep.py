"""Expert parallelism under the coverage table's MoE section: every MoE family's tested class trained one step under
each layout ("ep,tp,pp") with HybridParallelPlugin(ep_size=ep, tp_size=tp, pp_size=pp) (dp = ep) against the unsharded
model, with the router's load-balancing loss on where the config has one; results appended to a JSON-lines log (one
line per family and layout), resumed like the (tp, pp) log."""
from __future__ import annotations

import json
import os
import time
from typing import Dict, List

from hp_check.launch import spawn

from coverage_rows import Family
from coverage_run import append as _append


EP_LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "coverage_ep.jsonl")


def parse_layout(text: str) -> tuple:
    ep, tp, pp = (int(x) for x in text.split(","))
    return ep, tp, pp


def layout_key(layout: tuple) -> str:
    return ",".join(str(x) for x in layout)


def _moe_config(config_class):
    """The tiny config with the router's load-balancing loss on where the family has one; (config, aux_on)."""
    from hp_check.tiny import tiny_config
    defaults = config_class()
    extra = {}
    if hasattr(defaults, "output_router_logits"):
        extra["output_router_logits"] = True
    if getattr(defaults, "router_aux_loss_coef", None) is not None:
        extra["router_aux_loss_coef"] = 1.0
    aux = "output_router_logits" in extra and "router_aux_loss_coef" in extra
    return tiny_config(config_class, **extra), aux


def compare_ep(build, ep: int, tp: int, pp: int, tol: float = 1e-5):
    """One step under HybridParallelPlugin(tp_size=tp, pp_size=pp, ep_size=ep) (dp = world / (tp * pp)) against
    the unsharded model: hp_check.compare's check with expert parameters gathered over ep. Returns (result,
    detail) alike on every rank."""
    import copy

    import torch
    import torch.distributed as dist

    from booster_plugin import Booster, HybridParallelPlugin
    import importlib
    hc = importlib.import_module("hp_check.compare")  # (the package exports its function `compare` too)

    torch.manual_seed(0)
    reference = build().float()
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    world = dist.get_world_size()
    dp = world // (tp * pp)
    nmb = max(pp, 2)
    local_size = hc.MICROBATCH * nmb
    data = hc.batch(local_size * dp, seed=1)
    reference.train()
    try:  # the unsharded step first: a model that fails on its own fails on every rank, before any collective
        ref_losses = []
        for r in range(dp):
            for m in range(0, local_size, hc.MICROBATCH):
                mb = {k: v[r * local_size + m:r * local_size + m + hc.MICROBATCH] for k, v in data.items()}
                ref_losses.append(hc.criterion(reference(**mb), mb))
        torch.stack(ref_losses).mean().backward()
    except Exception as error:  # noqa: BLE001
        return "untested", f"the unsharded model fails: {type(error).__name__}: {str(error).splitlines()[0]}"
    plugin = HybridParallelPlugin(tp_size=tp, pp_size=pp, ep_size=ep, num_microbatches=nmb)
    try:
        model, opt, *_ = Booster(plugin=plugin).boost(model, opt, hc.criterion)
    except (NotImplementedError, ValueError) as refused:  # raised on every rank before any collective
        return "refused", str(refused).splitlines()[0].split(" Supported models:")[0]
    except TypeError as refused:  # the experts' forward lacks the routing arguments expert parallelism needs
        if "expert parallelism" not in str(refused):
            raise
        return "refused", str(refused).splitlines()[0]
    model.train()
    local = {k: v[plugin.dp_rank * local_size:(plugin.dp_rank + 1) * local_size] for k, v in data.items()}
    per = len(ref_losses) // dp
    ref_loss = torch.stack(ref_losses[plugin.dp_rank * per:(plugin.dp_rank + 1) * per]).mean()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters(remove_duplicate=False)
                 if p.grad is not None}
    loss = plugin.execute_pipeline(iter([local]), model, hc.criterion, opt, return_loss=True)["loss"]
    opt.step()
    ref_opt.step()
    found = []  # (0 loss/gradient, 1 parameter after the step; model order; message)
    got, want = loss.detach().float().item(), ref_loss.detach().item()
    if not abs(got - want) <= tol * (1 + abs(want)):
        found.append((0, -1, f"loss {got:.6g} != {want:.6g}"))
    experts = model.info.expert_params
    tp_group = plugin.tp_group if tp > 1 else None
    ep_group = plugin.ctx.ep.group
    order = {n: i for i, (n, _) in enumerate(reference.named_parameters(remove_duplicate=False))}
    ref_params = dict(reference.named_parameters(remove_duplicate=False))

    def full(name, p, tensor):  # over tp, then over ep for expert parameters (collective: same order on the group)
        t = hc._full(p, tensor, tp_group)
        if name not in experts:
            return t
        parts = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(parts, t.contiguous(), group=ep_group)
        return torch.cat(parts)

    for name, p in model.unwrap().named_parameters():
        grad, want_grad = p.grad, ref_grads.get(name)
        grad = full(name, p, grad) if grad is not None else None  # (None alike on the ep group: same stage)
        if (grad is None) != (want_grad is None):
            found.append((0, order[name], f"gradient of {name}: {'missing' if grad is None else 'unexpected'}"))
        elif grad is not None and not hc._close(grad, want_grad, tol):
            found.append((0, order[name], f"gradient of {name} differs by {hc._error(grad, want_grad)}"))
        value, expected = full(name, p, p.data), ref_params[name].data
        if not hc._close(value, expected, tol):
            found.append((1, order[name], f"parameter {name} after AdamW differs by {hc._error(value, expected)}"
                          + hc._at_gradient(value, expected, grad, want_grad)))
    everyone = [None] * world
    dist.all_gather_object(everyone, min(found) if found else None)
    found = sorted(m for m in everyone if m is not None)
    return ("fail", found[0][2]) if found else ("pass", "")


def _run_ep_families(todo: List[Family], path: str, layout: tuple) -> None:
    import torch.distributed as dist
    import transformers

    key = layout_key(layout)
    for family in todo:
        if dist.get_rank() == 0:
            _append(path, {"model_type": family.model_type, "layout": key, "started": True})
        start = time.time()
        aux = False
        if family.model_class == "-":
            verdict = ("untested", "no model class for this config in transformers' auto mappings")
        else:
            cls = getattr(transformers, family.model_class)
            try:
                config, aux = _moe_config(cls.config_class)
            except Exception as error:  # noqa: BLE001  (same on every rank, before any collective)
                verdict = ("untested", f"no tiny config: {type(error).__name__}: {str(error).splitlines()[0]}")
            else:
                verdict = _unbuildable(cls, config) or compare_ep(lambda: cls(config), *layout)
        if dist.get_rank() == 0:
            _append(path, {"model_type": family.model_type, "layout": key, "result": verdict[0],
                           "detail": verdict[1], "aux_loss": aux, "seconds": round(time.time() - start, 1)})


def finished_ep(path: str) -> Dict[tuple, Dict]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return {(r["model_type"], r["layout"]): r for r in records if "result" in r}


def run_ep(todo: List[Family], layouts: List[tuple], path: str, timeout: float, skip: set) -> None:
    """Every MoE family of `todo` under each layout (resumed from `path`)."""
    moe = [f for f in todo if f.kind == "MoE"]
    for layout in layouts:
        key, world = layout_key(layout), layout[0] * layout[1] * layout[2]
        for f in moe:  # not run (see --skip): carried as untested with the reason
            if f.model_type in skip and (f.model_type, key) not in finished_ep(path):
                _append(path, {"model_type": f.model_type, "layout": key, "result": "untested",
                               "detail": "not run: its tiny config still allocates a 32 GiB tensor (a size this "
                                         "script does not shrink)"})
        start = time.time()
        while True:
            done = finished_ep(path)
            left = [f for f in moe if (f.model_type, key) not in done]
            if not left:
                break
            reports = spawn(world, _run_ep_families, left, path, layout, timeout_s=timeout, total_s=3 * 3600)
            done = finished_ep(path)
            crashed = next((f for f in left if (f.model_type, key) not in done), None)
            if crashed is not None:  # crashed a rank or hung: record it, go on after it
                errors = [r[2] for r in reports if r[1] == "error"]
                detail = errors[0].splitlines()[0][:300] if errors else "a rank hung or died"
                _append(path, {"model_type": crashed.model_type, "layout": key, "result": "fail", "detail": detail})
            print(f"ep {key}: {sum((f.model_type, key) in finished_ep(path) for f in moe)}/{len(moe)} families "
                  f"done ({time.time() - start:.0f} s)", flush=True)


def _unbuildable(cls, config):
    """("untested", why) when the family's model cannot be built from its tiny config (the same on every rank,
    before any collective: not a failure of the parallel layout), else None."""
    try:
        cls(config)
    except Exception as error:  # noqa: BLE001
        return "untested", f"no tiny model: {cls.__name__}(tiny config) fails: {type(error).__name__}: " \
                           f"{str(error).splitlines()[0] if str(error) else ''}"
    return None
