"""Pipeline × data parallel training equals single-process training (GPT-2 with tied embeddings, Llama)."""
import warnings

import pytest
import torch
import torch.distributed as dist

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.compat import PipelineGraph, ScheduledNode
from booster_plugin.core.microbatches import split_batch
from booster_plugin.compat.v_schedule import fingerprint, nodes_to_schedule
from pipeline import PipelineStageManager
from pipeline.actions import B, F, I, Action, add_communication
from pipeline.layout import V, StageLayout
from pipeline.p2p import flatten, unflatten
from pipeline.simulator import simulate
from tests import model_utils as mu
from tests.dist_utils import run_distributed
from tests.test_memory import eight_rank_cases as eight_rank_memory_cases


# -- pure logic -------------------------------------------------------------------------------------------------
def test_distribute_layers_gives_remainder_to_middle_stages():
    assert PipelineStageManager.distribute_layers(8, 4) == [2, 2, 2, 2]
    assert PipelineStageManager.distribute_layers(10, 4) == [2, 3, 3, 2]
    assert PipelineStageManager.distribute_layers(5, 2) == [2, 3]
    assert PipelineStageManager.distribute_layers(7, 4) == [1, 2, 2, 2]
    with pytest.raises(ValueError, match="at least one layer"):
        PipelineStageManager.distribute_layers(3, 4)


def test_split_batch_checks_divisibility():
    batch = {"input_ids": torch.arange(12).view(6, 2), "flag": True}
    parts = split_batch(batch, num_microbatches=3, microbatch_size=None)
    assert [p["input_ids"].tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    assert all(p["flag"] is True for p in parts)
    assert len(split_batch(batch, None, microbatch_size=2)) == 3
    assert len(split_batch(batch, 3, microbatch_size=2)) == 3  # both, agreeing (as ColossalAI)
    with pytest.raises(ValueError, match=r"Batch size 6 != num_microbatches=2 \* microbatch_size=2"):
        split_batch(batch, 2, microbatch_size=2)
    with pytest.raises(ValueError, match="not divisible into num_microbatches=4"):
        split_batch(batch, num_microbatches=4, microbatch_size=None)
    with pytest.raises(ValueError, match="share dim 0"):
        split_batch({"a": torch.zeros(4), "b": torch.zeros(3)}, 2, None)
    with pytest.raises(TypeError, match="dict of tensors"):
        split_batch([torch.zeros(4)], 2, None)


def test_p2p_structure_round_trip_without_pickle():
    obj = {"h": torch.ones(2, 3), "pair": (torch.zeros(1), [1, "x", None]), "flag": False, "s": 1.5}
    tree, tensors = flatten(obj)
    back = unflatten(tree, tensors)
    assert back["pair"][1] == [1, "x", None] and isinstance(back["pair"], tuple) and back["s"] == 1.5
    assert back["h"] is tensors[0] and len(tensors) == 2
    with pytest.raises(TypeError, match="not set"):
        flatten({"bad": {1, 2}})


# -- 2 ranks -------------------------------------------------------------------------------------------------------
def _check_trace(out_dir: str):
    """With trace=True each rank records every microbatch's forward and backward; rank 0 writes the timeline."""
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=4, trace=True)
    booster = Booster(plugin=plugin)
    model = mu.build("llama_lm")
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters()))
    for step in range(2):
        booster.execute_pipeline(iter([mu.make_batch("llama_lm", 8, step)]), model, mu.criterion, opt)
        opt.step()
    kinds = [e[0] for e in plugin.schedule.tracer.events if e[4] == 1]
    assert kinds.count(0) == 4 and kinds.count(1) == 4 and kinds.count(5) == 1, kinds  # fwd, bwd, optimizer
    summary = plugin.write_trace(out_dir)
    if dist.get_rank() == 0:
        import json, os
        assert 0 <= summary["measured_bubble"] < 1 and summary["theoretical_bubble"] == pytest.approx(0.2)
        trace = json.load(open(os.path.join(out_dir, "trace.json")))
        assert {e["tid"] for e in trace["traceEvents"]} == {0, 1}
        assert os.path.getsize(os.path.join(out_dir, "timeline.png")) > 0
    off = HybridParallelPlugin(pp_size=2, num_microbatches=4)
    assert off.schedule.tracer is None  # off by default


def _check_bf16_keeps_fp32_master_weights(kind: str):
    """precision='bf16': bf16 compute, fp32 master weights stepped by the optimizer, losses near fp32's."""
    reference = mu.build(kind)
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2, precision="bf16")
    booster = Booster(plugin=plugin)
    model = mu.build(kind)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = mu.make_batch(kind, 4, 0)
    expected = mu.microbatch_mean_loss(reference, batch, 2).item()
    loss = booster.execute_pipeline(iter([batch]), model, mu.criterion, opt)["loss"].item()
    assert abs(loss - expected) < 2e-2 * abs(expected), (loss, expected)
    opt.step()
    names = dict(opt.named_parameters())
    assert names and all(m.dtype == torch.float32 for m in names.values())
    for name, p in model.unwrap().named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.data, names[name].data.to(torch.bfloat16)), name
        assert not torch.equal(names[name].data, mu.build(kind).get_parameter(name).data), f"{name} did not move"


def _check_shapes_change_between_steps():
    """The metadata cache re-sends shapes when a step's sequence length differs from the last step's."""
    reference = mu.build("llama_lm").eval()
    for transport in ("p2p", "broadcast"):
        booster = Booster(plugin=HybridParallelPlugin(pp_size=2, num_microbatches=2, p2p_transport=transport))
        model, *_ = booster.boost(mu.build("llama_lm"))
        model.eval()
        for seq in (8, 5, 5, 8):
            batch = {k: v[:, :seq] for k, v in mu.make_batch("llama_lm", 4, seq).items()}
            with torch.no_grad():
                loss = booster.execute_pipeline(iter([batch]), model, mu.criterion)["loss"]
                mu.assert_close(loss, mu.microbatch_mean_loss(reference, batch, 2), f"seq {seq} via {transport}")


def _two_ranks(tmp_dir: str):
    # pp=2: tied GPT-2, Llama, both classification heads, the base models, uneven and user-given splits
    for kind in ("gpt2_lm", "llama_lm", "gpt2_cls", "llama_cls", "gpt2", "llama"):
        mu.check_training(kind, pp_size=2, num_microbatches=4)
    mu.check_training("llama_lm", layers=5, pp_size=2, num_microbatches=2)
    mu.check_training("gpt2_lm", layers=5, pp_size=2, num_microbatches=4, num_layers_per_stage=[1, 4])
    # clipping on the global norm; both microbatch settings, agreeing with the batch (8 = 4 * 2), as ColossalAI
    mu.check_training("gpt2_lm", pp_size=2, num_microbatches=4, microbatch_size=2, max_norm=0.05)
    mu.check_training("llama_lm", pp_size=2, num_microbatches=4, p2p_transport="broadcast")
    mu.check_training("llama_lm", pp_size=2, num_microbatches=2, enable_metadata_cache=False)
    for kind in ("gpt2_lm", "llama_lm", "llama"):
        mu.check_evaluation(kind, pp_size=2, num_microbatches=4)
    _check_memory_promise()
    _check_shapes_change_between_steps()
    _check_bf16_keeps_fp32_master_weights("llama_lm")
    _check_bf16_keeps_fp32_master_weights("gpt2_lm")  # its position-embedding stand-in follows the dtype
    _check_trace(tmp_dir)
    _check_policy_reports_what_the_stage_holds()
    _check_schedule_input_errors()
    # several chunks per rank: interleaved (loop layout) and zero-bubble V (tied GPT-2 embedding and head on rank 0)
    for style in MULTI_CHUNK:
        for kind in ("gpt2_lm", "llama_lm"):
            mu.check_training(kind, pp_size=2, num_microbatches=4, **style)
        mu.check_evaluation("llama_lm", pp_size=2, num_microbatches=4, **style)
    mu.check_training("gpt2_lm", layers=5, pp_size=2, microbatch_size=2, max_norm=0.05, **ZBV)  # uneven chunks
    mu.check_training("llama_lm", layers=6, pp_size=2, num_microbatches=4, num_layers_per_stage=[1, 2, 2, 1],
                      **INTERLEAVED)
    _check_memory_promise(ZBV)
    _check_memory_promise(DUALPIPEV)  # one more chunk activation than zbv
    for kind in ("gpt2_lm", "llama_lm"):  # dualpipev: full backwards in the steady state, split ones on the ramps
        mu.check_training(kind, pp_size=2, num_microbatches=4, **DUALPIPEV)
    mu.check_training("llama_lm", pp_size=2, num_microbatches=4, pp_schedule_costs="measured", **DUALPIPEV)
    mu.check_evaluation("gpt2_lm", pp_size=2, num_microbatches=4, **DUALPIPEV)
    mu.check_training("llama_cls", pp_size=2, local_batch=4, **DUALPIPEV)  # automatic microbatches: 4 (>= 2p)
    _check_zbv_plans_for_measured_costs()
    _check_colossalai_scheduler_nodes()
    _check_auto_split()


def _check_auto_split():
    """num_layers_per_stage="auto": the last stage, which also runs the (big) LM head and loss, gets fewer layers;
    training stays exact; a user-given list still wins."""
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2, num_layers_per_stage="auto")
    model, *_ = Booster(plugin=plugin).boost(mu.build("gpt2_lm", layers=5))
    assert model.policy.layers_per_stage() == [3, 2]  # the even split is [2, 3]; the head costs ~1/4 layer here
    mu.check_training("gpt2_lm", layers=5, pp_size=2, num_microbatches=4, num_layers_per_stage="auto")
    with pytest.raises(ValueError, match="num_layers_per_stage must be a list, None or 'auto'"):
        HybridParallelPlugin(pp_size=2, num_microbatches=2, num_layers_per_stage="even")


INTERLEAVED = dict(pp_style="interleaved", num_model_chunks=2)
ZBV = dict(pp_style="zbv", num_model_chunks=2)
DUALPIPEV = dict(pp_style="dualpipev", num_model_chunks=2)
MULTI_CHUNK = (INTERLEAVED, ZBV)


def _check_memory_promise(style=None):
    """1F1B keeps at most pp_size microbatches of activations alive on the first stage (GPipe would keep all 8);
    every schedule stays within the activations its generator promised (what the simulator checks)."""
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=8, **(style or {}))
    booster = Booster(plugin=plugin)
    model = mu.build("llama_lm")
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0))
    booster.execute_pipeline(iter([mu.make_batch("llama_lm", 8, 0)]), model, mu.criterion, opt)
    promised = plugin.schedule.plan(8)[0].max_activations[plugin.stage_manager.stage]
    expected = plugin.pp_size - plugin.stage_manager.stage if style is None else promised
    assert plugin.schedule.peak_inflight_microbatches == expected <= promised, plugin.schedule.peak_inflight_microbatches


def _check_zbv_plans_for_measured_costs():
    """pp_schedule_costs="measured": zbv re-plans its order once per number of microbatches, after the first training
    step, from the compute times measured on every rank (pipeline/refine.py); the next steps train exactly under it
    (check_training: 2 steps).
    A schedule set by hand through use_schedule, here with every backward whole (B, no I/W split), trains exactly."""
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=4, pp_schedule_costs="measured", **ZBV)
    booster = Booster(plugin=plugin)
    model = mu.build("llama_lm")
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    unit = plugin.schedule.plan(4)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed re-plan warns and keeps the order: that would fail here
        booster.execute_pipeline(iter([mu.make_batch("llama_lm", 8, 0)]), model, mu.criterion, opt)
    refined = plugin.schedule.plan(4)[0]
    assert refined is not unit and simulate(refined).makespan > 0  # re-planned, and valid
    assert plugin.schedule.plan(4)[1] != simulate(unit).bubble  # its bubble: under the measured costs
    mine = torch.tensor([fingerprint(refined)])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    assert len({int(t) for t in every}) == 1  # one order on every rank
    with torch.no_grad():  # evaluation neither measures nor re-plans
        booster.execute_pipeline(iter([mu.make_batch("llama_lm", 8, 1)]), model, mu.criterion)
    assert plugin.schedule.plan(4)[0] is refined
    assert not HybridParallelPlugin(pp_size=2, num_microbatches=4, **ZBV).schedule._to_measure  # off by default
    mu.check_training("gpt2_lm", pp_size=2, num_microbatches=4, pp_schedule_costs="measured", **ZBV)  # tied, exact
    compute = [[Action(B, a.stage, a.microbatch) if a.kind == I else a for a in acts if a.kind in (F, I, B)]
               for acts in unit.actions]
    whole = unit._replace(actions=add_communication(compute, unit.layout))
    mu.check_training("llama_lm", pp_size=2, num_microbatches=4, prepare=lambda p: p.schedule.use_schedule(whole),
                      **ZBV)


def _check_colossalai_scheduler_nodes():
    """A ColossalAI zbv script's `scheduler_nodes=PipelineGraph(...).get_v_schedule()` runs that order as given
    (transfer nodes in the lists are ignored: derived from the compute order) and trains exactly."""
    nodes = PipelineGraph(n_stage=2, n_micro=4, f_cost=1000, b_cost=1000, w_cost=1000, c_cost=1, f_mem=1, b_mem=-1,
                          w_mem=0).get_v_schedule()
    assert [sorted({n.type for n in rank}) for rank in nodes] == [["B", "F", "W"]] * 2
    lists = [[ScheduledNode("RECV_FORWARD", 0, r, 0)] + list(rank) + [ScheduledNode("SEND_BACKWARD", 1, r, 3)]
             for r, rank in enumerate(nodes)]
    expected = nodes_to_schedule(nodes, StageLayout(2, 2, V))

    def runs_the_nodes(plugin):
        assert plugin.schedule.plan(4)[0] == expected and 4 in plugin.schedule._measured  # not re-planned

    mu.check_training("llama_lm", pp_size=2, num_microbatches=4, scheduler_nodes=lists, prepare=runs_the_nodes,
                      **ZBV)


def _check_policy_reports_what_the_stage_holds():
    """ColossalAI's Policy API on a sharded GPT-2: held layers per stage, and the tied embedding/head as shared."""
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2)
    model, *_ = Booster(plugin=plugin).boost(mu.build("gpt2_lm"))
    policy, hf = model.policy, model.unwrap()
    held = {id(m) for m in policy.get_held_layers()}
    if plugin.stage_manager.is_first_stage():
        expected = [hf.transformer.wte, hf.transformer.wpe, hf.transformer.drop, hf.transformer.h[0], hf.transformer.h[1]]
        shared = {0: hf.transformer.wte.weight}
    else:
        expected = [hf.transformer.h[2], hf.transformer.h[3], hf.transformer.ln_f, hf.lm_head]
        shared = {1: hf.lm_head.weight}
    assert held == {id(m) for m in expected}
    assert [{s: id(p) for s, p in d.items()} for d in policy.get_shared_params()] == [{s: id(p) for s, p in shared.items()}]
    assert policy.shared_param_names() == [{0: "transformer.wte.weight", 1: "lm_head.weight"}]


def _check_schedule_input_errors():
    """Schedule choices that cannot work are refused on every rank before any collective (the general bad-input
    table is tests/test_reliability.py)."""
    with pytest.raises(ValueError, match="multiple of pp_size"):
        HybridParallelPlugin(pp_size=2, num_microbatches=3, **INTERLEAVED)
    with pytest.raises(ValueError, match="pp_style='zbv' needs num_model_chunks=2"):
        HybridParallelPlugin(pp_size=2, num_microbatches=2, pp_style="zbv")
    with pytest.raises(ValueError, match="dualpipev schedule needs num_microbatches >= 2 \\* pp_size"):
        HybridParallelPlugin(pp_size=2, num_microbatches=3, **DUALPIPEV)
    with pytest.raises(ValueError, match="pp_schedule_costs='fast': use 'measured' or 'unit'"):
        HybridParallelPlugin(pp_size=2, num_microbatches=2, pp_schedule_costs="fast", **ZBV)
    with pytest.raises(ValueError, match="Unknown pp_style 'gpipe'"):
        HybridParallelPlugin(pp_size=2, num_microbatches=2, pp_style="gpipe")
    with pytest.raises(ValueError, match="p2p_transport='p2p'"):
        HybridParallelPlugin(pp_size=2, num_microbatches=2, p2p_transport="broadcast", **ZBV)
    with pytest.raises(ValueError, match="Cannot split 3 layers over 4 virtual pipeline stages"):
        Booster(plugin=HybridParallelPlugin(pp_size=2, num_microbatches=2, **ZBV)).boost(mu.build("gpt2_lm", layers=3))
    dist.barrier()  # nobody is stuck in a collective


def test_pipeline_two_ranks(tmp_path):
    run_distributed(2, _two_ranks, str(tmp_path))


# -- 4 ranks: pp=4, and pp=2 × dp=2 ---------------------------------------------------------------------------------
def _check_dataloader_shards_over_dp_only():
    """prepare_dataloader: the stages of one replica see the same batches; replicas see disjoint ones."""
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2)  # dp=2
    dataset = [{"input_ids": torch.tensor([i])} for i in range(16)]
    loader = plugin.prepare_dataloader(dataset, batch_size=4, shuffle=True, seed=3)
    mine = torch.cat([b["input_ids"].flatten() for b in loader])
    everyone = [torch.empty_like(mine) for _ in range(4)]
    dist.all_gather(everyone, mine)
    by_dp = {}
    for rank, seen in enumerate(everyone):
        by_dp.setdefault(rank // 2, []).append(seen)  # ranks (dp, pp): 0,1 -> dp 0; 2,3 -> dp 1
    for seen in by_dp.values():
        assert torch.equal(seen[0], seen[1])
    assert sorted(torch.cat([by_dp[0][0], by_dp[1][0]]).tolist()) == list(range(16))


def _check_pipeline_accumulation(kind: str, k: int = 2, no_sync: bool = True, **plugin_kwargs):
    """k execute_pipeline calls, all but the last inside booster.no_sync, then one optimizer step: the same
    gradients and parameters as one process on the k-times larger batch; no dp reduction starts before the last.
    `no_sync=False`: every call reduces its own part (as ColossalAI), with the same result."""
    plugin = HybridParallelPlugin(**plugin_kwargs)
    booster = Booster(plugin=plugin)
    reference = mu.build(kind)
    model = mu.build(kind)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6))
    dp, local, mb = plugin.dp_size, 4, 4 // plugin_kwargs["num_microbatches"]
    calls = [mu.make_batch(kind, local * dp, seed=50 + c) for c in range(k)]
    whole = {key: torch.cat([c[key] for c in calls]) for key in calls[0]}  # one process: all calls at once
    replicas = [{key: torch.cat([c[key][r * local:(r + 1) * local] for c in calls]) for key in calls[0]}
                for r in range(dp)]
    torch.stack([mu.microbatch_mean_loss(reference, rep, mb) for rep in replicas]).mean().backward()
    ref_opt.step()
    scaled = lambda out, batch: mu.criterion(out, batch) / k  # noqa: E731  (the user's 1/k, as with any accumulation)
    for c, batch in enumerate(calls):
        mine = {key: v[plugin.dp_rank * local:(plugin.dp_rank + 1) * local] for key, v in batch.items()}
        if c < k - 1 and no_sync:
            with booster.no_sync(model, opt):
                booster.execute_pipeline(iter([mine]), model, scaled, opt)
            assert not any(b.launched for b in model._buckets), "a dp reduction started inside no_sync"
            assert model.require_grad_sync
        else:
            booster.execute_pipeline(iter([mine]), model, scaled, opt)
    opt.step()
    tp_group = plugin.tp_group if plugin.tp_size > 1 else None
    for name, p in model.unwrap().named_parameters():
        ref = reference.get_parameter(name)
        if plugin.zero_stage == 2:  # (only the slices exist)
            continue
        mu.assert_close(mu.gathered(p, p.grad, tp_group), ref.grad, f"accumulated grad of {name} ({whole['input_ids'].shape[0]} samples)")
    for name, p in model.unwrap().named_parameters():
        mu.assert_close(mu.gathered(p, p.data, tp_group), reference.get_parameter(name).data,
                        f"param {name} after AdamW")


def _check_gradient_accumulation_with_no_sync():
    """dp=4: backward passes inside booster.no_sync accumulate locally; the reduction runs once, with the sum.
    Without no_sync (as torch DDP) each backward reduces its own part: the same gradients."""
    plugin = HybridParallelPlugin()  # dp = 4
    booster = Booster(plugin=plugin)
    reference = mu.build("llama_lm")
    model = mu.build("llama_lm")
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    halves = [mu.make_batch("llama_lm", 16, seed) for seed in (1, 2)]
    for half in halves:  # reference: every replica's shard of both halves, averaged over replicas
        for r in range(4):
            part = {k: v[r * 4:(r + 1) * 4] for k, v in half.items()}
            (reference(**part).loss / 4).backward()
    mine = [{k: v[plugin.dp_rank * 4:(plugin.dp_rank + 1) * 4] for k, v in h.items()} for h in halves]
    with booster.no_sync(model):
        booster.backward(model(**mine[0]).loss, opt)
    booster.backward(model(**mine[1]).loss, opt)
    model.sync_grads()
    for name, p in model.unwrap().named_parameters():
        mu.assert_close(p.grad, reference.get_parameter(name).grad, f"accumulated grad of {name}")
    opt.zero_grad()
    booster.backward(model(**mine[0]).loss, opt)
    booster.backward(model(**mine[1]).loss, opt)
    for name, p in model.unwrap().named_parameters():
        mu.assert_close(p.grad, reference.get_parameter(name).grad, f"grad of {name} accumulated without no_sync")
    opt.zero_grad()
    booster.backward(model(**mine[0]).loss, opt)
    opt.step()
    dist.barrier()


def _check_token_weighted_loss_equals_one_process():
    """loss_weight_fn: microbatches and replicas weighted by label tokens, so a padded global batch trains exactly
    like one process on it (the plain model loss, a mean over all label tokens of the global batch)."""
    from shardformer.stage.loss_weights import causal_lm_label_tokens

    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=4, loss_weight_fn=causal_lm_label_tokens)  # dp=2
    booster = Booster(plugin=plugin)
    reference = mu.build("llama_lm")
    model = mu.build("llama_lm")
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    batch = mu.make_batch("llama_lm", 16, 3)
    batch["labels"][5, :6] = -100  # uneven label counts across microbatches and replicas
    batch["labels"][9, 2:] = -100
    local = {k: v[plugin.dp_rank * 8:(plugin.dp_rank + 1) * 8] for k, v in batch.items()}
    with torch.no_grad():
        expected_local = reference(**local).loss
    reference(**batch).loss.backward()
    ref_opt.step()
    loss = booster.execute_pipeline(iter([local]), model, mu.criterion, opt)["loss"]
    mu.assert_close(loss, expected_local, "this replica's token-mean loss")
    opt.step()
    for name, p in model.unwrap().named_parameters():
        mu.assert_close(p.grad, reference.get_parameter(name).grad, f"token-weighted grad of {name}")
        mu.assert_close(p.data, reference.get_parameter(name).data, f"param {name} after AdamW")


def _four_ranks():
    _check_dataloader_shards_over_dp_only()
    _check_token_weighted_loss_equals_one_process()
    _check_gradient_accumulation_with_no_sync()
    for kind in ("gpt2_lm", "llama_lm"):
        mu.check_training(kind, pp_size=4, num_microbatches=4)
        mu.check_training(kind, pp_size=2, num_microbatches=2)  # dp=2
    mu.check_training("llama_lm", layers=6, pp_size=4, num_microbatches=8)  # uneven: [1, 2, 2, 1]
    mu.check_training("gpt2_lm", pp_size=4, num_microbatches=4, max_norm=0.05)
    mu.check_evaluation("gpt2_lm", pp_size=4, num_microbatches=4)
    mu.check_evaluation("llama_lm", pp_size=2, num_microbatches=2)
    # gradient accumulation over pipeline steps, pp=2 x dp=2, every schedule
    for style in ({}, *MULTI_CHUNK):  # 1f1b: without no_sync (tied embedding and head summed over stages)
        _check_pipeline_accumulation("gpt2_lm", pp_size=2, num_microbatches=2, no_sync=bool(style), **style)
    _check_pipeline_accumulation("gpt2_lm", k=3, no_sync=False, pp_size=2, num_microbatches=2, zero_stage=2)
    # several chunks per rank: pp=4 (8 virtual stages), pp=2 x dp=2, tp=2 x pp=2
    mu.check_training("llama_lm", layers=8, pp_size=4, num_microbatches=4, **INTERLEAVED)
    mu.check_training("gpt2_lm", layers=8, pp_size=4, num_microbatches=4, **ZBV)
    mu.check_evaluation("gpt2_lm", layers=8, pp_size=4, num_microbatches=4, **INTERLEAVED)
    mu.check_evaluation("llama_lm", layers=8, pp_size=4, num_microbatches=4, **ZBV)
    mu.check_training("gpt2_lm", pp_size=2, num_microbatches=2, **INTERLEAVED)  # dp=2
    mu.check_training("llama_lm", pp_size=2, num_microbatches=2, **ZBV)  # dp=2
    mu.check_training("llama_lm", tp_size=2, pp_size=2, num_microbatches=2, **INTERLEAVED)
    mu.check_training("gpt2_lm", tp_size=2, pp_size=2, num_microbatches=2, **ZBV)
    mu.check_training("gpt2_lm", tp_size=2, pp_size=2, num_microbatches=4, **DUALPIPEV)
    mu.check_training("llama_lm", pp_size=2, num_microbatches=4, **DUALPIPEV)  # dp=2
    _check_pipeline_accumulation("llama_lm", pp_size=2, num_microbatches=4, **DUALPIPEV)
    mu.check_training("llama_lm", layers=8, pp_size=4, num_microbatches=8, **DUALPIPEV)


def test_pipeline_four_ranks():
    run_distributed(4, _four_ranks)


# -- 8 ranks: pp=4 × dp=2 ---------------------------------------------------------------------------------------------
def _eight_ranks():
    for kind in ("gpt2_lm", "llama_lm"):
        mu.check_training(kind, pp_size=4, num_microbatches=4)
    mu.check_evaluation("llama_lm", pp_size=4, num_microbatches=4)
    eight_rank_memory_cases()  # ZeRO-1/2 at (tp, pp, dp) = (2, 2, 2), from test_memory.py
    # tp=2 x pp=2 x dp=2: accumulation over pipeline steps (1f1b and zbv), multi-chunk training
    _check_pipeline_accumulation("llama_lm", tp_size=2, pp_size=2, num_microbatches=2)
    _check_pipeline_accumulation("gpt2_lm", tp_size=2, pp_size=2, num_microbatches=2, **ZBV)
    mu.check_training("llama_lm", layers=8, pp_size=4, num_microbatches=4, **ZBV)  # dp=2


def test_pipeline_eight_ranks():
    run_distributed(8, _eight_ranks)
