"""Compare a sharded model with the unsharded one on every rank of an initialized group: the loss of one training
step, every gradient and every parameter after one AdamW step (fp32). Collective; the verdict is the same on every
rank and names the first mismatch: the loss, else the first gradient (Hugging Face name, model order) that differs,
else the first parameter after the step."""
from __future__ import annotations

import copy
import inspect
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from pipeline.groups import world_group
from torch import nn

from booster_plugin import Booster, HybridParallelPlugin
from shardformer.layer.spec import gather_tensor, get_tp_spec
from shardformer.multimodal_batch import image_rows, take_samples

from .batches import batch, missing_inputs

MICROBATCH = 2


class Verdict(NamedTuple):
    result: str                       # "pass", "refused", "fail", or "untested" (the unsharded model fails)
    detail: str = ""                  # the refusal's reason, or the first mismatch
    max_loss_error: Optional[float] = None


def criterion(outputs, micro_batch) -> torch.Tensor:
    """The model's own loss where it computes one (with a second head's, e.g. GPT-2's multiple-choice loss), else a
    function of the last hidden states."""
    if getattr(outputs, "loss", None) is not None:
        return outputs.loss + outputs.mc_loss if getattr(outputs, "mc_loss", None) is not None else outputs.loss
    return outputs.last_hidden_state.float().sin().mean()


def compare(build: Callable[[], nn.Module], tp: int, pp: int, policy=None, tol: float = 1e-5,
            progress: Callable[[str], None] = lambda _: None, lr: float = 1e-3) -> Verdict:
    """One step of the sharded model (tp, pp, dp = world / (tp * pp)) against the unsharded one; `progress(what)` is
    told each phase."""
    torch.manual_seed(0)
    progress("building the model")
    reference = build().float()
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6)
    world = dist.get_world_size()
    dp = world // (tp * pp)
    local_size = MICROBATCH * max(pp, 2)
    data = batch(local_size * dp, seed=1, model=reference)
    missing = missing_inputs(reference, data)
    if missing:  # (alike on every rank)
        return Verdict("untested", f"needs inputs this check does not build: {', '.join(missing)}")
    ragged = image_rows(reference.config)  # (images go with their samples)
    reference.train()
    progress("unsharded step")
    try:  # the unsharded step first: a model that fails on its own fails on every rank, before any collective
        ref_losses = []
        for r in range(dp):  # the step's loss: mean over microbatches and replicas
            for m in range(0, local_size, MICROBATCH):
                mb = take_samples(data, r * local_size + m, r * local_size + m + MICROBATCH, ragged)
                ref_losses.append(criterion(reference(**mb), mb))
        torch.stack(ref_losses).mean().backward()
    except Exception as error:  # noqa: BLE001
        return Verdict("untested", f"the unsharded model fails: {type(error).__name__}: {str(error).splitlines()[0]}")
    plugin = HybridParallelPlugin(tp_size=tp, pp_size=pp, num_microbatches=max(pp, 2), custom_policy=policy)
    progress("sharding (boost)")
    try:
        model, opt, *_ = Booster(plugin=plugin).boost(model, opt, criterion)
    except (NotImplementedError, ValueError) as refused:  # raised on every rank before any collective
        return Verdict("refused", str(refused).splitlines()[0].split(" Supported models:")[0])
    model.train()
    local = take_samples(data, plugin.dp_rank * local_size, (plugin.dp_rank + 1) * local_size, ragged)
    ref_loss = torch.stack(ref_losses[plugin.dp_rank * (len(ref_losses) // dp):
                                      (plugin.dp_rank + 1) * (len(ref_losses) // dp)]).mean()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters(remove_duplicate=False)
                 if p.grad is not None}
    progress("sharded step")
    loss = plugin.execute_pipeline(iter([local]), model, criterion, opt, return_loss=True)["loss"]
    opt.step()
    ref_opt.step()
    progress("comparing loss, gradients, parameters")
    mismatches = []  # (0 loss/gradient, 1 parameter after the step; model order; message)
    got, want_loss = loss.detach().float().item(), ref_loss.detach().item()
    loss_error = abs(got - want_loss)
    if not loss_error <= tol * (1 + abs(want_loss)):
        mismatches.append((0, -1, f"loss {got:.6g} != {want_loss:.6g}"))
    mismatches += _param_mismatches(model.unwrap(), reference, ref_grads, plugin.tp_group if tp > 1 else None, tol)
    everyone = [None] * world
    dist.all_gather_object(everyone, min(mismatches) if mismatches else None, group=world_group())
    found = sorted(m for m in everyone if m is not None)
    if found:
        return Verdict("fail", found[0][2], loss_error)
    return Verdict("pass", "", loss_error)


def _param_mismatches(sharded: nn.Module, reference: nn.Module, ref_grads: Dict[str, torch.Tensor], group,
                      tol: float) -> List[Tuple[int, int, str]]:
    """(0 gradient / 1 parameter after the step, model order, message) of each parameter of `sharded` that differs
    from `reference`'s (collective over tp: on every rank alike)."""
    order = {n: i for i, (n, _) in enumerate(reference.named_parameters(remove_duplicate=False))}
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    found = []
    for name, p in sharded.named_parameters():
        grad, want = p.grad, ref_grads.get(name)
        grad = _full(p, grad, group) if grad is not None else None
        if (grad is None) != (want is None):
            found.append((0, order[name], f"gradient of {name}: {'missing' if grad is None else 'unexpected'}"))
        elif grad is not None and not _close(grad, want, tol):
            found.append((0, order[name], f"gradient of {name} differs by {_error(grad, want)}"))
        full, expected = _full(p, p.data, group), ref_params[name].data
        if not _close(full, expected, tol):
            found.append((1, order[name], f"parameter {name} after AdamW differs by "
                          f"{_error(full, expected)}" + _at_gradient(full, expected, grad, want)))
    return found


def _at_gradient(actual, expected, grad, want) -> str:
    """Where a parameter differs after the step: its gradient there (Adam's first step moves an element by
    lr * g / (|g| + eps), so the rounding of a near-zero gradient is amplified up to lr / eps times)."""
    if grad is None or want is None or actual.shape != expected.shape or grad.shape != want.shape:
        return ""
    i = int((actual.float() - expected.float()).abs().argmax())
    return f" where its gradient is {float(grad.flatten()[i]):.3g} (unsharded: {float(want.flatten()[i]):.3g})"


def _full(param: torch.Tensor, tensor: torch.Tensor, group) -> torch.Tensor:
    spec = get_tp_spec(param)
    return tensor if spec is None or group is None else gather_tensor(tensor, spec, group)


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> bool:
    return actual.shape == expected.shape and torch.allclose(actual.float(), expected.float(), rtol=tol, atol=tol)


def _error(actual: torch.Tensor, expected: torch.Tensor) -> str:
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    return f"{float((actual.float() - expected.float()).abs().max()):.3g} (max abs)"
