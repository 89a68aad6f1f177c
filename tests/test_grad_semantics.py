"""`p.grad` is final when the backward returns (booster.backward, a plain loss.backward(), execute_pipeline), as in
one process and torch DDP: a script's changes to the gradients before optimizer.step() take effect in every layout
and ZeRO stage that keeps `p.grad`; ZeRO-2 (no `p.grad`) refuses a gradient set by the script. An optimizer that
did not go through `boost` is refused at its step. Backward passes repeated without no_sync accumulate (as torch
DDP)."""
import copy

import pytest
import torch
import torch.distributed as dist

from booster_plugin import Booster, HybridParallelPlugin
from tests import model_utils as mu
from tests.dist_utils import run_distributed

LOCAL = 4  # samples per replica


def _change(named_grads):
    """What a script does to the gradients: halve all in place, replace some, drop one (identical everywhere)."""
    for name, p in named_grads:
        if p.grad is None:
            continue
        p.grad.mul_(0.5)
        if ".0." in name:  # first decoder layer: a new tensor (not in place)
            p.grad = p.grad * 3
        if name.endswith("ln_f.bias") or name.endswith("model.norm.weight"):
            p.grad = None  # masked out: the optimizer skips the parameter


def _reference(kind, global_batch, dp, mb):
    reference = mu.build(kind)
    losses = [mu.microbatch_mean_loss(reference, {k: v[r * LOCAL:(r + 1) * LOCAL] for k, v in global_batch.items()},
                                      mb) for r in range(dp)]
    torch.stack(losses).mean().backward()
    grads = {n: p.grad.clone() for n, p in reference.named_parameters(remove_duplicate=False)}
    return reference, grads


def _check_changes_take_effect(kind, **plugin_kwargs):
    plugin = HybridParallelPlugin(**plugin_kwargs)
    booster = Booster(plugin=plugin)
    dp, mb = plugin.dp_size, LOCAL // plugin_kwargs.get("num_microbatches", 1)
    global_batch = mu.make_batch(kind, LOCAL * dp, seed=3)
    reference, ref_grads = _reference(kind, global_batch, dp, mb)
    model = copy.deepcopy(reference)
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=1.0))
    local = {k: v[plugin.dp_rank * LOCAL:(plugin.dp_rank + 1) * LOCAL] for k, v in global_batch.items()}
    if plugin.schedule is not None:
        booster.execute_pipeline(iter([local]), model, mu.criterion, opt)
    else:
        mu.criterion(model(**local), local).backward()  # a plain backward, as with torch DDP
    tp = plugin.tp_group if plugin.tp_size > 1 else None
    for name, p in model.unwrap().named_parameters():  # final on return: averaged over dp, summed over stages
        mu.assert_close(mu.gathered(p, p.grad, tp), ref_grads[name], f"{plugin_kwargs}: grad of {name} after backward")
    _change(model.unwrap().named_parameters())
    _change(reference.named_parameters())
    opt.step()
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    for name, p in model.unwrap().named_parameters():
        mu.assert_close(mu.gathered(p, p.data, tp), reference.get_parameter(name).data,
                        f"{plugin_kwargs}: {name} after a step with changed gradients")


def _check_clip_grad_norm_under_dp():
    """torch.nn.utils.clip_grad_norm_ between backward and step (dp=4: every rank holds whole gradients)."""
    plugin = HybridParallelPlugin()
    booster = Booster(plugin=plugin)
    global_batch = mu.make_batch("llama_lm", LOCAL * 4, seed=4)
    reference, _ = _reference("llama_lm", global_batch, 4, LOCAL)
    model = copy.deepcopy(reference)
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=1.0))
    local = {k: v[plugin.dp_rank * LOCAL:(plugin.dp_rank + 1) * LOCAL] for k, v in global_batch.items()}
    booster.backward(mu.criterion(model(**local), local), opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    mu.assert_close(norm, ref_norm, "clip_grad_norm_'s norm")
    opt.step()
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    for name, p in model.unwrap().named_parameters():
        mu.assert_close(p.data, reference.get_parameter(name).data, f"{name} after a clipped step")


def _check_zero2_refuses_a_set_gradient():
    plugin = HybridParallelPlugin(zero_stage=2)
    booster = Booster(plugin=plugin)
    model = mu.build("llama_lm")
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=1.0))
    batch = mu.make_batch("llama_lm", LOCAL, seed=5)
    booster.backward(mu.criterion(model(**batch), batch), opt)
    assert all(p.grad is None for p in model.parameters()), "ZeRO-2 keeps only the partitioned gradients"
    p = next(model.parameters())
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="zero_stage=2 partitions the gradients"):
        opt.step()
    opt.zero_grad()


def _check_optimizer_not_boosted_is_refused():
    """pp=2 x dp=2, GPT-2 with its tied embedding and LM head: an optimizer built after boost, or the original
    optimizer object stepped instead of the boosted one, would skip the tied sum: refused at its step."""
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2)
    booster = Booster(plugin=plugin)
    model = mu.build("gpt2_lm")
    original = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, *_ = booster.boost(model, original)
    batch = mu.make_batch("gpt2_lm", LOCAL, seed=6)
    for stray in (torch.optim.AdamW(model.parameters(), lr=0.1), original):
        booster.execute_pipeline(iter([batch]), model, mu.criterion, opt)
        with pytest.raises(RuntimeError, match="did not go through booster.boost"):
            stray.step()
        opt.step()  # the boosted one steps
        opt.zero_grad()


def _check_replicas_out_of_step_are_refused():
    """dp=4, the script calls the model itself: a forward that failed on one rank and was caught (here: a forward
    with gradients on rank 1 only) would pair rank 1's next step with the others' current one. The backward raises
    on every rank instead, naming the counts; after zero_grad the replicas train on."""
    plugin = HybridParallelPlugin()
    booster = Booster(plugin=plugin)
    model = mu.build("llama_lm")
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = mu.make_batch("llama_lm", LOCAL, seed=7)
    if dist.get_rank() == 1:
        model(**batch)  # its loss never reaches a backward (as if the step had failed here and was skipped)
    with pytest.raises(RuntimeError, match=r"replicas are out of step: .* ran \[1, 2, 1, 1\] forward passes"):
        booster.backward(model(**batch).loss, opt)
    opt.zero_grad()
    booster.backward(model(**batch).loss, opt)
    opt.step()
    opt.zero_grad()


def _check_repeated_backward(kind, k=2, **plugin_kwargs):
    """Accumulation without no_sync, as torch DDP and ColossalAI: k booster.backward calls, each reducing its own
    part, then one step: the sum of the k per-batch mean-over-dp gradients and AdamW's parameters of one process."""
    plugin = HybridParallelPlugin(**plugin_kwargs)
    booster = Booster(plugin=plugin)
    reference = mu.build(kind)
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6))
    dp, tp = plugin.dp_size, plugin.tp_group if plugin.tp_size > 1 else None
    for c in range(k):
        batch = mu.make_batch(kind, LOCAL * dp, seed=20 + c)
        parts = [{n: v[r * LOCAL:(r + 1) * LOCAL] for n, v in batch.items()} for r in range(dp)]
        torch.stack([mu.criterion(reference(**part), part) for part in parts]).mean().backward()
        mine = parts[plugin.dp_rank]
        booster.backward(mu.criterion(model(**mine), mine), opt)
    for name, p in model.unwrap().named_parameters():
        if plugin.zero_stage < 2:  # (ZeRO-2: only the slices exist)
            mu.assert_close(mu.gathered(p, p.grad, tp), reference.get_parameter(name).grad,
                            f"{plugin_kwargs}: grad of {name} after {k} backwards")
    opt.step()
    ref_opt.step()
    for name, p in model.unwrap().named_parameters():
        mu.assert_close(mu.gathered(p, p.data, tp), reference.get_parameter(name).data,
                        f"{plugin_kwargs}: {name} after AdamW on {k} accumulated backwards")
    opt.zero_grad()


def _four_ranks():
    _check_changes_take_effect("llama_lm")  # dp=4
    _check_changes_take_effect("gpt2_lm", pp_size=2, num_microbatches=2)  # dp=2, tied embedding over stages
    _check_changes_take_effect("llama_lm", tp_size=2)  # dp=2
    _check_changes_take_effect("llama_lm", zero_stage=1)  # dp=4
    _check_changes_take_effect("gpt2_lm", pp_size=2, num_microbatches=2, zero_stage=1)
    _check_clip_grad_norm_under_dp()
    _check_zero2_refuses_a_set_gradient()
    _check_optimizer_not_boosted_is_refused()
    _check_replicas_out_of_step_are_refused()
    for zero_stage in (0, 1, 2):  # dp=2
        _check_repeated_backward("llama_lm", k=2 + (zero_stage == 2), tp_size=2, zero_stage=zero_stage)


def test_gradient_semantics_four_ranks():
    run_distributed(4, _four_ranks)
