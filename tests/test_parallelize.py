"""Paddle-style `parallelize(model, optimizer, mesh, config)`: Llama trained with a Paddle-style loop through a
parallelize_plan and split_spec equals the HybridParallelPlugin path (Llama's plan-derived policy) and the unsharded
model; plans that do not map are refused.
(`four_ranks` runs in tests/test_seeds.py, one process group for all three files.)"""
import copy

import pytest
import torch

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.compat.parallelize import ParallelizedModel, _sizes, parallelize
from pipeline import ProcessGroupMesh
from shardformer.policies.from_paddle import (ColWiseParallel, RowWiseParallel, SequenceParallelBegin, SplitPoint,
                                              resolve_plan, resolve_split)
from shardformer.policies.base import Colwise, Rowwise, VocabEmbedding, VocabHead
from shardformer.policies import get_autopolicy
from tests import model_utils as mu
from tests.readme_blocks import readme_block

LLAMA_PLAN = {
    "model.embed_tokens": RowWiseParallel(),                      # vocab-parallel embedding
    "model.layers.*.self_attn.q_proj": ColWiseParallel(),
    "model.layers.*.self_attn.k_proj": ColWiseParallel(),
    "model.layers.*.self_attn.v_proj": ColWiseParallel(),
    "model.layers.*.self_attn.o_proj": RowWiseParallel(),
    r"model\.layers\.\d+\.mlp\.(gate|up)_proj": ColWiseParallel(),  # a regular expression
    "model.layers.*.mlp.down_proj.weight": RowWiseParallel(),       # a parameter name
    "lm_head.weight": ColWiseParallel(),                           # vocab-parallel head and loss
}


def test_plan_resolves_to_the_built_in_policy():
    model = mu.build("llama_lm")
    styles = resolve_plan(model, LLAMA_PLAN)
    derived = get_autopolicy(model).tp_plan  # Llama's policy, derived from its transformers plans
    expected = {f"model.{p.replace('*', str(i))}": s for p, s in derived.items() for i in range(4)}
    assert styles == {**expected, "lm_head": VocabHead()}
    assert styles["model.embed_tokens"] == VocabEmbedding() and styles["model.layers.3.mlp.up_proj"] == Colwise()
    assert styles["model.layers.0.self_attn.o_proj"] == Rowwise()
    assert resolve_split(model, "model.layers", 2) == ("model.layers", None)
    assert resolve_split(model, {"model.layers.0": SplitPoint.END}, 2) == ("model.layers", [1, 3])
    assert resolve_split(model, {"model.layers.1": SplitPoint.BEGINNING, "model.layers.2": SplitPoint.END},
                         3) == ("model.layers", [1, 2, 1])


@pytest.mark.parametrize("plan, error, message", [
    ({"model.embed_tokens": [ColWiseParallel(), SequenceParallelBegin()]}, NotImplementedError,
     "SequenceParallelBegin is not supported"),
    ({"model.embed_tokens": ColWiseParallel()}, NotImplementedError, "RowWiseParallel splits its vocabulary"),
    ({"model.norm": ColWiseParallel()}, NotImplementedError, "LlamaRMSNorm"),
    ({"model.layers.*.attn.q": ColWiseParallel()}, ValueError, "matches no module"),
])
def test_unsupported_plans_are_refused(plan, error, message):
    with pytest.raises(error, match=message):
        resolve_plan(mu.build("llama_lm"), plan)


def test_bad_split_specs_are_refused():
    model = mu.build("llama_lm")
    with pytest.raises(ValueError, match="pp=3 needs 2"):
        resolve_split(model, {"model.layers.1": SplitPoint.END}, 3)
    with pytest.raises(ValueError, match="not a list of layers"):
        resolve_split(model, "model.norm", 2)


def _train_like_paddle(model, optimizer, batches):
    """The loop of Paddle's docs (torch's zero_grad for clear_grad)."""
    losses = []
    model.train()
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _readme_example(model, optimizer, batches):
    """The README's worked example: mesh {"pp": 2, "mp": 2}, LLAMA_PLAN, split_spec "model.layers"."""
    namespace = {"model": model, "optimizer": optimizer, "batches": batches}
    exec(readme_block("### Another model, Paddle's way"), namespace)
    return namespace["model"], namespace["losses"]


def _with(mesh, config):
    def run(model, optimizer, batches):
        model, optimizer = parallelize(model, optimizer, mesh, config)
        return model, _train_like_paddle(model, optimizer, batches)
    return run


def _compare(run, plugin_kwargs, steps=2, local_batch=8):
    """`run` (a parallelize path) equals the plugin path with `plugin_kwargs` exactly and the reference to 1e-5."""
    reference = mu.build("llama_lm")
    via_plan, via_plugin = copy.deepcopy(reference), copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    booster = Booster(plugin=HybridParallelPlugin(**plugin_kwargs))
    other, other_opt, *_ = booster.boost(via_plugin, torch.optim.AdamW(via_plugin.parameters(), lr=1e-3, eps=1e-6))
    plugin = booster.plugin
    dp, dp_rank, mb = plugin.dp_size, plugin.dp_rank, local_batch // plugin_kwargs.get("num_microbatches", 1)
    globals_ = [mu.make_batch("llama_lm", local_batch * dp, seed=100 + s) for s in range(steps)]
    local = [{k: v[dp_rank * local_batch:(dp_rank + 1) * local_batch] for k, v in g.items()} for g in globals_]
    model, losses = run(via_plan, torch.optim.AdamW(via_plan.parameters(), lr=1e-3, eps=1e-6), local)
    assert isinstance(model, ParallelizedModel)
    other.train()
    for step, batch in enumerate(local):
        out = booster.execute_pipeline(iter([batch]), other, mu.criterion, other_opt)
        other_opt.step()
        other_opt.zero_grad()
        mu.assert_close(losses[step], out["loss"], f"step {step} loss: plan vs plugin path")
        ref_opt.zero_grad()
        ref_losses = [mu.microbatch_mean_loss(reference, {k: v[r * local_batch:(r + 1) * local_batch]
                                                          for k, v in globals_[step].items()}, mb) for r in range(dp)]
        torch.stack(ref_losses).mean().backward()
        ref_opt.step()
        mu.assert_close(losses[step], ref_losses[dp_rank].detach(), f"step {step} loss")
    if plugin.pp_size > 1:  # evaluation: the loss on every stage, the outputs on the last
        model.eval()
        with torch.no_grad():
            out = model(**local[0])
            expected = mu.microbatch_mean_loss(reference.eval(), local[0], mb)
        mu.assert_close(out.loss, expected, "eval loss")
        assert (out.outputs is not None) == plugin.stage_manager.is_last_stage()
    ours, theirs = dict(model.unwrap().named_parameters()), dict(other.unwrap().named_parameters())
    assert ours.keys() == theirs.keys()
    ref = dict(reference.named_parameters())
    tp_group = plugin.tp_group if plugin.tp_size > 1 else None
    for name, p in ours.items():
        # same math, but Llama's plugin policy is derived from transformers' plans (one input all-reduce per
        # attention/MLP region) while this plan reduces per column layer: equal up to fp32 summation order
        mu.assert_close(p, theirs[name], f"{name}: plan vs plugin path")
        mu.assert_close(mu.gathered(p, p.data, tp_group), ref[name].data, f"param {name}")


def four_ranks():
    _compare(_readme_example, dict(tp_size=2, pp_size=2, num_microbatches=2))
    _compare(_with({"dp": 2, "pp": 2}, {"dp_config": {"sharding_level": 2},  # ZeRO-2
                                        "pp_config": {"split_spec": {"model.layers.0": SplitPoint.END},
                                                      "accumulate_steps": 2}}),
             dict(pp_size=2, num_microbatches=2, num_layers_per_stage=[1, 3], zero_stage=2))
    _compare(_with({"dp": 2, "mp": 2}, {"mp_config": {"parallelize_plan": LLAMA_PLAN}}),  # no pipeline
             dict(tp_size=2, num_microbatches=1))
    assert _sizes(ProcessGroupMesh(2, 2, 1)) == (2, 2, 1) == _sizes({"pp": 2})
    assert _sizes(None) == (4, 1, 1)
    with pytest.raises(ValueError, match="needs 8 processes"):
        _sizes({"dp": 2, "pp": 2, "mp": 2})
    with pytest.raises(NotImplementedError, match="sharding_level=3 is not supported"):
        parallelize(mu.build("llama_lm"), config={"dp_config": {"sharding_level": 3}})
    with pytest.raises(ValueError, match="divide_attributes"):  # OPT: no built-in policy, num_heads to divide
        parallelize(mu.build("opt_lm"), mesh={"mp": 2}, config={"mp_config": {"parallelize_plan": {
            "model.decoder.layers.*.self_attn.q_proj": ColWiseParallel()}}})
