"""ColossalAI compatibility: the design card's line verbatim, a ColossalAI script ported by its imports only, every
ColossalAI plugin argument accepted by name with its documented status, and ColossalAI's attribute semantics."""
import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.compat.colossal_args import UNACTED_ARGS
from booster_plugin.compat import DistCoordinator, HybridAdam, LazyInitContext, get_accelerator, set_seed
from tests import model_utils as mu
from tests.dist_utils import run_distributed

# ColossalAI 0.5 HybridParallelPlugin's arguments and defaults (its signature), except tp_size/pp_size
COLOSSALAI_DEFAULTS = dict(
    sp_size=None, precision="fp16", zero_stage=0, enable_all_optimization=False, enable_fused_normalization=False,
    enable_flash_attention=False, enable_jit_fused=False, enable_sequence_parallelism=False,
    sequence_parallelism_mode=None, parallel_output=True, num_microbatches=None, microbatch_size=None,
    initial_scale=2 ** 16, min_scale=1, growth_factor=2, backoff_factor=0.5, growth_interval=1000, hysteresis=2,
    max_scale=2 ** 32, max_norm=0, broadcast_buffers=True, ddp_bucket_cap_mb=25, find_unused_parameters=False,
    check_reduction=False, gradient_as_bucket_view=False, static_graph=False, zero_bucket_size_in_m=12,
    cpu_offload=False, communication_dtype=None, overlap_communication=True, custom_policy=None, pp_style="1f1b",
    num_model_chunks=1, scheduler_nodes=None, num_layers_per_stage=None, gradient_checkpoint_config=None,
    enable_metadata_cache=True, make_vocab_size_divisible_by=64, dp_outside=True, overlap_p2p=True,
    overlap_allgather=False, fp8_communication=False, use_fp8=False, inner_ring_size=None)


# -- 8 ranks -----------------------------------------------------------------------------------------------------------
def _check_design_card_line():
    """`booster.boost(model, optimizer, plugin=HybridParallelPlugin(tp=2, pp=4))`, verbatim: no microbatch setting
    (each step picks 8 microbatches of 1 from its batch of 8), trains like one process."""
    reference = mu.build("llama_lm")
    model = copy.deepcopy(reference)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    booster = Booster()
    model, optimizer, *_ = booster.boost(model, optimizer, plugin=HybridParallelPlugin(tp=2, pp=4))
    assert (booster.plugin.tp_size, booster.plugin.pp_size, booster.plugin.dp_size) == (2, 4, 1)
    for step in range(2):
        batch = mu.make_batch("llama_lm", 8, seed=step)
        ref_opt.zero_grad()
        expected = mu.microbatch_mean_loss(reference, batch, 1)
        expected.backward()
        ref_opt.step()
        loss = booster.execute_pipeline(iter([batch]), model, mu.criterion, optimizer)["loss"]
        assert booster.plugin.schedule.num_microbatches == 8
        mu.assert_close(loss, expected.detach(), f"step {step} loss")
        optimizer.step()
        optimizer.zero_grad()
        for name, p in model.unwrap().named_parameters():
            mu.assert_close(mu.gathered(p, p.data, booster.plugin.tp_group), reference.get_parameter(name).data,
                            f"step {step} {name}")


def _check_ported_colossalai_script(tmp_dir: str):
    """examples/colossalai_port.py (a ColossalAI script with only its imports changed) on tp=2 x pp=2 x dp=2, from a
    pretrained checkpoint, gives one process's losses (AdamW, clipping, an LR schedule); its asynchronous checkpoint
    loads with from_pretrained and equals one process's parameters. The same script with fp16 and ZeRO-1 follows
    the fp32 losses within mixed-precision tolerance."""
    from transformers import GPT2LMHeadModel

    from examples import colossalai_port as script

    config = mu.gpt2_config()
    init, saved = os.path.join(tmp_dir, "pretrained"), os.path.join(tmp_dir, "trained")
    torch.manual_seed(3)
    reference = GPT2LMHeadModel(config)
    if dist.get_rank() == 0:
        reference.save_pretrained(init)
    dist.barrier()
    losses = script.train(tp=2, pp=2, steps=3, init_from=init, config=config, save_to=saved)
    # the script's enable_all_optimization compiles the layers: the fp32 run above checks them; the fp16 run's layers
    # run eagerly (compiling their fp16 graphs too would cost this launch ~10 s more)
    with torch._dynamo.config.patch(disable=True):
        fp16_losses = script.train(tp=2, pp=2, steps=3, init_from=init, config=config, precision="fp16",
                                   zero_stage=1)

    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    dp_rank = dist.get_rank() // 4  # (dp, pp, tp) order: ranks 0-3 are replica 0
    for step, batch in enumerate(script.make_batches(3, 8, 16, config.vocab_size)):
        mine = {k: v[dp_rank * 4:(dp_rank + 1) * 4] for k, v in batch.items()}
        with torch.no_grad():
            expected = reference(**mine).loss.item()
        opt.zero_grad()
        reference(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        sched.step()
        assert abs(losses[step] - expected) < 1e-5, (step, losses[step], expected)
        assert abs(fp16_losses[step] - expected) < 2e-2, ("fp16 + ZeRO-1", step, fp16_losses[step], expected)
    assert fp16_losses != losses, "the fp16 run computed in fp32"
    if dist.get_rank() == 0:
        loaded = GPT2LMHeadModel.from_pretrained(os.path.join(saved, "model"))
        for name, p in reference.named_parameters():
            mu.assert_close(loaded.get_parameter(name).data, p.data, f"async checkpoint {name}")
    dist.barrier()


def _eight_ranks(tmp_dir: str):
    _check_design_card_line()
    _check_ported_colossalai_script(tmp_dir)


def test_compat_eight_ranks(tmp_path):
    run_distributed(8, _eight_ranks, str(tmp_path))


# -- 2 ranks -----------------------------------------------------------------------------------------------------------
def _check_every_colossalai_argument_is_accepted():
    """All of ColossalAI's arguments by name at their defaults (our precision default differs: fp32) construct a
    plugin without a warning; a speed-only option warns on rank 0 only; a result-changing one is refused."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin = HybridParallelPlugin(tp_size=2, pp_size=1, **{**COLOSSALAI_DEFAULTS, "precision": "fp32"})
    assert plugin.stage_manager is None and plugin.tp_size == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        HybridParallelPlugin(tp_size=2, pp_size=1, enable_flash_attention=True, fp8_communication=True)
    mine = [str(w.message) for w in caught if "ignores options" in str(w.message)]
    if dist.get_rank() == 0:  # (enable_flash_attention acts: plugins/speed.py)
        assert len(mine) == 1 and "fp8_communication=True" in mine[0] and "results are unaffected" in mine[0]
        assert "enable_flash_attention" not in mine[0]
    else:
        assert mine == []
    with pytest.raises(ValueError, match="sp_size=2 splits the sequence over a group of its own: also set"):
        HybridParallelPlugin(tp_size=2, pp_size=1, sp_size=2)  # as in ColossalAI: sp_size needs SP enabled
    with warnings.catch_warnings(record=True) as caught:  # as in ColossalAI: a mode alone is ignored
        warnings.simplefilter("always")
        assert HybridParallelPlugin(tp_size=2, sequence_parallelism_mode="all_to_all").sp_mode is None
    mine = [str(w.message) for w in caught if "is ignored without enable_sequence_parallelism" in str(w.message)]
    assert len(mine) == (1 if dist.get_rank() == 0 else 0), mine
    dist.barrier()


def _check_colossalai_attribute_semantics():
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2)
    assert plugin.stage_manager is not None and plugin.stage_manager.num_stages == 2
    assert plugin.pg_mesh.get_ranks_in_group(plugin.pp_group) == (0, 1)
    tp_plugin = HybridParallelPlugin(tp_size=2, max_norm=0.5)
    assert tp_plugin.stage_manager is None
    assert tp_plugin.pg_mesh.get_ranks_in_group(tp_plugin.tp_group) == (0, 1)
    booster = Booster(plugin=tp_plugin)
    reference = mu.build("gpt2_lm")
    model = copy.deepcopy(reference)
    model, optimizer, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-3, eps=1e-6))
    assert optimizer.get_grad_norm() is None
    batch = mu.make_batch("gpt2_lm", 4, 0)
    booster.backward(model(**batch).loss, optimizer)
    optimizer.step()
    reference(**batch).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    assert abs(optimizer.get_grad_norm() - expected.item()) < 1e-5, (optimizer.get_grad_norm(), expected)
    with pytest.raises(AttributeError, match="'HybridParallelOptimizer' object \\(wrapping HybridAdam\\) has no"):
        optimizer.no_such_thing
    with pytest.warns(UserWarning, match="mixed_precision='fp16'.*ignored"):
        Booster(mixed_precision="fp16", plugin=tp_plugin)


def _check_companions():
    """DistCoordinator, HybridAdam, LazyInitContext, get_accelerator, set_seed behave as ColossalAI's."""
    coordinator = DistCoordinator()
    assert coordinator.is_master() == (dist.get_rank() == 0) and coordinator.world_size == 2
    assert coordinator.is_last_process() == (dist.get_rank() == 1)
    marker = f"/tmp/priority-{os.environ['MASTER_PORT']}"
    with coordinator.priority_execution():  # rank 0 runs the block first: rank 1 then sees what it wrote
        if dist.get_rank() == 0:
            open(marker, "w").close()
        else:
            assert os.path.exists(marker)
    coordinator.block_all()
    if dist.get_rank() == 0:
        os.remove(marker)
    assert coordinator.on_master_only()(lambda: "ran")() == ("ran" if dist.get_rank() == 0 else None)
    assert get_accelerator().get_current_device() == torch.device("cpu") and get_accelerator().device_count() == 1

    for adamw_mode, torch_cls, extra in ((True, torch.optim.AdamW, {}), (False, torch.optim.Adam, {})):
        set_seed(5)
        a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        b.load_state_dict(a.state_dict())
        ours = HybridAdam(a.parameters(), lr=0.1, weight_decay=0.1, adamw_mode=adamw_mode)
        theirs = torch_cls(b.parameters(), lr=0.1, weight_decay=0.1)
        for _ in range(2):
            for m, o in ((a, ours), (b, theirs)):
                o.zero_grad()
                m(torch.ones(2, 4)).square().sum().backward()
                o.step()
        assert torch.equal(a.weight, b.weight), f"adamw_mode={adamw_mode}"

    with LazyInitContext():
        lazy = mu.MODELS["llama_lm"]()
    assert all(p.is_meta for p in lazy.parameters())
    model, *_ = Booster(plugin=HybridParallelPlugin(tp_size=2, enable_sequence_parallelism=True)).boost(lazy)
    assert not any(p.is_meta for p in model.parameters())
    # the materialized replicated norms keep their gradient sum over tp (they see half of the sequence each)
    model.train()
    model(**mu.make_batch("llama_lm", 2, 0)).loss.backward()
    grad = model.unwrap().model.layers[0].input_layernorm.weight.grad
    parts = [torch.empty_like(grad) for _ in range(2)]
    dist.all_gather(parts, grad)
    assert torch.equal(parts[0], parts[1])


def _two_ranks():
    _check_every_colossalai_argument_is_accepted()
    _check_colossalai_attribute_semantics()
    _check_companions()


def test_compat_two_ranks():
    run_distributed(2, _two_ranks)


def test_argument_table_covers_colossalai():
    """Every ColossalAI argument is either in the plugin's signature or in the table of unacted arguments."""
    import inspect
    ours = set(inspect.signature(HybridParallelPlugin.__init__).parameters) | set(UNACTED_ARGS)
    assert set(COLOSSALAI_DEFAULTS) - ours == set()
    assert set(UNACTED_ARGS) <= set(COLOSSALAI_DEFAULTS)
    for name, arg in UNACTED_ARGS.items():
        assert arg.default == COLOSSALAI_DEFAULTS[name], name
