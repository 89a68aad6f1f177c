"""Bad input fails clearly, the same way on every rank, before any collective (afterwards the group still works);
inputs that a vocab-parallel layer would silently mask are refused; a microbatch without label tokens trains as in
one process; replicas of replicated weights are made identical over tp; evaluation outputs are full logits; a model
the program drops is freed."""
import copy
import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.compat import PipelineGraph
from shardformer import Policy
from shardformer.stage.loss_weights import causal_lm_label_tokens
from tests import model_utils as mu
from tests.dist_utils import run_distributed

# -- plugin arguments: refused at construction, naming the value and the valid choices (2 ranks) ---------------------
ZBV2 = dict(pp_size=2, pp_style="zbv", num_model_chunks=2)
NODES_M2 = PipelineGraph(n_stage=2, n_micro=2, f_cost=1, b_cost=1, w_cost=1, c_cost=0, f_mem=1, b_mem=-1,
                         w_mem=0).get_v_schedule()  # ColossalAI's way to build scheduler_nodes
CONFIG_CASES = [
    (dict(tp_size=0), ValueError, "tp_size must be an integer >= 1, got 0"),
    (dict(pp_size=-1), ValueError, "pp_size must be an integer >= 1, got -1"),
    (dict(tp_size=1.5), ValueError, "tp_size must be an integer >= 1, got 1.5"),
    (dict(tp_size=3), ValueError, "World size 2 is not divisible by tp_size \\* pp_size = 3 \\* 1"),
    (dict(pp_size=4, num_microbatches=4), ValueError, "World size 2 is not divisible by tp_size \\* pp_size = 1 \\* 4"),
    (dict(tp=2, tp_size=4), ValueError, "tp=2 and tp_size=4 disagree"),
    (dict(pp_size=2, microbatch_size=0), ValueError, "microbatch_size must be an integer >= 1, got 0"),
    (dict(pp_size=2, microbatch_size=-2), ValueError, "microbatch_size must be an integer >= 1, got -2"),
    (dict(pp_size=2, num_microbatches=0), ValueError, "num_microbatches must be an integer >= 1, got 0"),
    (dict(pp_size=2, num_microbatches=1), ValueError, "num_microbatches >= pp_size"),
    (dict(precision="fp64"), ValueError, "precision='fp64' is not supported; use one of"),
    (dict(zero_stage=3), ValueError, "zero_stage=3 is not supported; use 0, 1 or 2"),
    (dict(pp_style="gpipe"), ValueError, "Unknown pp_style 'gpipe'; use one of"),
    (dict(pp_size=2, num_microbatches=3, pp_style="interleaved", num_model_chunks=2), ValueError,
     "interleaved schedule needs num_microbatches to be a multiple of pp_size"),
    (dict(enable_sequence_parallelism=True), ValueError,
     "enable_sequence_parallelism=True \\(sequence_parallelism_mode='split_gather'\\) splits the sequence over the tp "
     "group without sp_size, but tp_size=1"),
    (dict(tp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="ring_cp"), NotImplementedError,
     "sequence_parallelism_mode='ring_cp' is not supported; use 'split_gather'"),
    (dict(sp_size=2), ValueError, "sp_size=2 splits the sequence over a group of its own: also set "
     "enable_sequence_parallelism=True"),
    (dict(tp_size=2, sp_size=4, enable_sequence_parallelism=True), ValueError,
     "World size 2 is not divisible by tp_size \\* pp_size \\* sp_size = 2 \\* 1 \\* 4"),
    (dict(ZBV2, scheduler_nodes=[[]]), ValueError, "scheduler_nodes has 1 lists, one per pipeline stage is needed"),
    (dict(ZBV2, scheduler_nodes=[[n for n in rank if n.type != "W"] for rank in NODES_M2]), ValueError,
     "scheduler_nodes do not form a valid zero-bubble schedule: microbatch 0 misses its backward"),
    (dict(ZBV2, scheduler_nodes=[[], []]), ValueError, "scheduler_nodes hold no F, B or W node"),
    (dict(ZBV2, pp_schedule_costs="measured"), ValueError, "pp_schedule_costs='measured' re-plans at a step every"),
    (dict(ZBV2, num_microbatches=4, scheduler_nodes=NODES_M2), ValueError,
     "scheduler_nodes order 2 microbatches but num_microbatches=4; build them with n_micro=4"),
    (dict(max_norm=-1.0), ValueError, "max_norm=-1.0 must be >= 0"),
    (dict(p2p_transport="nccl"), ValueError, "p2p_transport='nccl': use 'p2p' or 'broadcast'"),
    (dict(tp_sizes=2), TypeError, "unexpected keyword arguments \\['tp_sizes'\\]"),
    (dict(custom_policy=Policy), TypeError, "custom_policy must be a shardformer.Policy instance"),
    (dict(loss_weight_fn=len), ValueError, "loss_weight_fn weighs the microbatches"),
    (dict(timeout=-1), ValueError, "timeout=-1 must be a positive number of seconds"),
    (dict(on_nonfinite="nan"), ValueError, "on_nonfinite='nan': use 'skip', 'raise' or 'ignore'"),
    (dict(ddp_bucket_cap_mb=0), ValueError, "ddp_bucket_cap_mb=0 must be > 0"),
    (dict(make_vocab_size_divisible_by=0), ValueError, "make_vocab_size_divisible_by must be an integer >= 1"),
]


def _boost(plugin_kwargs, model, optimizer_fn=None, **boost_kwargs):
    booster = Booster(plugin=HybridParallelPlugin(**plugin_kwargs))
    optimizer = optimizer_fn(model) if optimizer_fn else None
    return booster.boost(model, optimizer, **boost_kwargs)


def _twice():
    model, *_ = _boost({}, mu.build("gpt2_lm"))
    Booster(plugin=HybridParallelPlugin()).boost(model)


def _conflicting_plugins():
    Booster(plugin=HybridParallelPlugin()).boost(mu.build("gpt2_lm"), plugin=HybridParallelPlugin())


def _gpt2_heads(n_head):
    config = mu.gpt2_config()
    config.n_head = n_head
    config.n_embd = 30
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel(config)


def _t5():
    from tests.test_encoder_decoder import t5_config
    from transformers import T5ForConditionalGeneration
    return T5ForConditionalGeneration(t5_config())


def _llama_kv_heads(kv_heads):
    config = mu.llama_config()
    config.num_key_value_heads = kv_heads
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM(config)


def _forward(plugin_kwargs, batch, kind="llama_lm"):
    model, *_ = _boost(plugin_kwargs, mu.build(kind))
    model.train()
    return model(**batch)


class _WrongPathPolicy(Policy):
    layers = "decoder.layers"  # an OPT path on GPT-2


# -- model / layout: refused at boost ----------------------------------------------------------------------------------
BOOST_CASES = [
    (lambda: _boost(dict(pp_size=2, num_microbatches=2), torch.nn.Linear(2, 2)), NotImplementedError,
     "No sharding policy for Linear.*custom_policy="),
    (lambda: _boost(dict(pp_size=2, num_microbatches=2), mu.build("gpt2_lm", layers=1)), ValueError,
     "Cannot split 1 layers over 2 pipeline stages"),
    (lambda: _boost(dict(pp_size=2, num_microbatches=2, num_layers_per_stage=[3, 3]), mu.build("gpt2_lm")),
     ValueError, "num_layers_per_stage=\\[3, 3\\] must have 2 positive entries summing to the model's 4 layers"),
    (lambda: _boost(dict(tp_size=2), _gpt2_heads(3)), ValueError, "tp_size=2 does not divide n_head=3"),
    (_twice, ValueError, "already boosted"),
    (_conflicting_plugins, ValueError, "already has a plugin"),
    (lambda: Booster(plugin="tp=2"), TypeError, "plugin must be a HybridParallelPlugin"),
    (lambda: HybridParallelPlugin(tp_size=1 + _rank()), ValueError,
     "created with different settings on different ranks \\(tp_size: rank 0 has 1, rank 1 has 2\\)"),
    (lambda: _boost(dict(pp_size=2, num_microbatches=2, custom_policy=_WrongPathPolicy()), mu.build("gpt2_lm")),
     ValueError, "_WrongPathPolicy.layers names 'decoder.layers', which GPT2Model .* has \\['wte', 'wpe'"),
    (lambda: _boost(dict(tp_size=2, enable_sequence_parallelism=True), _t5()), NotImplementedError,
     "enable_sequence_parallelism: T5ForConditionalGeneration is an encoder-decoder model"),
    (lambda: _boost(dict(tp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all"),
                    _llama_kv_heads(1)), ValueError,
     "'all_to_all' splits the key/value heads over tp ranks, but LlamaForCausalLM has 1 key/value heads for tp_size=2"),
]


def _step(plugin_kwargs, batch, kind="gpt2_lm", data_iter=None):
    booster = Booster(plugin=HybridParallelPlugin(**plugin_kwargs))
    model, *_ = booster.boost(mu.build(kind))
    return booster.execute_pipeline(data_iter if data_iter is not None else iter([batch]), model, mu.criterion)


def _rank():
    return dist.get_rank()


def _with(batch, key, index, value):
    batch = {k: v.clone() for k, v in batch.items()}
    batch[key][index] = value
    return batch


GOOD = mu.make_batch("gpt2_lm", 4, 0)
# -- data: every rank of the step sees the same batch, so each raises the same error before communicating -------------
STEP_CASES = [
    (lambda: _step(dict(pp_size=2, num_microbatches=4), mu.make_batch("gpt2_lm", 6, 0)), ValueError,
     "Batch size 6 is not divisible into num_microbatches=4"),
    (lambda: _step(dict(pp_size=2, num_microbatches=2, microbatch_size=2), mu.make_batch("gpt2_lm", 6, 0)),
     ValueError, "Batch size 6 != num_microbatches=2 \\* microbatch_size=2: give batches of 4 samples"),
    (lambda: _step(dict(pp_size=2), mu.make_batch("gpt2_lm", 1, 0)), ValueError,
     "A batch of 1 samples cannot be split into 2 to 8 equal microbatches"),
    (lambda: _step(dict(pp_size=2, pp_style="dualpipev", num_model_chunks=2), mu.make_batch("gpt2_lm", 3, 0)),
     ValueError, "A batch of 3 samples cannot be split into 4 to 8 equal microbatches for pp_size=2, "
                 "pp_style='dualpipev'"),  # dualpipev needs m >= 2p: its automatic choice starts there
    (lambda: _step(dict(pp_size=2, num_microbatches=2), None, data_iter=iter([])), ValueError,
     "exhausted data iterator"),
    (lambda: _step(dict(pp_size=2, num_microbatches=2), [GOOD["input_ids"]]), TypeError, "dict of tensors"),
    (lambda: _step(dict(pp_size=2, num_microbatches=2), {"input_ids": torch.zeros(4, 3, dtype=torch.long),
                                                         "labels": torch.zeros(3, 3, dtype=torch.long)}),
     ValueError, "share dim 0"),
    (lambda: _step(dict(tp_size=2, num_microbatches=2), _with(GOOD, "input_ids", (1, 2), mu.VOCAB)), IndexError,
     f"Token id {mu.VOCAB} on rank 0 \\(data-parallel replica 0\\) is outside the vocabulary \\[0, {mu.VOCAB}\\)"),
    (lambda: _step(dict(pp_size=2, num_microbatches=2), _with(GOOD, "input_ids", (0, 0), -3)), IndexError,
     "Token id -3 on rank 0 .* is outside the vocabulary"),  # stage 0 would raise alone; stage 1 would wait
    (lambda: _step(dict(pp_size=2, num_microbatches=2), _with(GOOD, "labels", (3, 1), mu.VOCAB + 5)), IndexError,
     f"Label {mu.VOCAB + 5} on rank 0 .* is out of bounds: labels must lie in \\[0, {mu.VOCAB}\\)"),
    (lambda: _step(dict(tp_size=2, num_microbatches=2), _with(GOOD, "labels", (3, 1), -7)), IndexError,
     "Label -7 on rank 0"),
    # only one rank's batch is bad: every rank raises (the others name the rank)
    (lambda: _step(dict(pp_size=2, num_microbatches=2), _with(GOOD, "input_ids", (0, 0), 500 if _rank() else 1)),
     IndexError, "Token id 500 on rank 1 \\(data-parallel replica 0\\)"),
    (lambda: _step(dict(tp_size=2, num_microbatches=2), {k: v[:, :6 + _rank()] for k, v in GOOD.items()}),
     ValueError, "The ranks of data-parallel replica 0 got different batches: rank [01] has tensor shapes"),
    (lambda: _step(dict(pp_size=2, num_microbatches=2), mu.make_batch("gpt2_lm", 4 + 2 * _rank(), 0)),
     ValueError, "different batches.*in 2 microbatches"),
    (lambda: _step(dict(num_microbatches=2), mu.make_batch("gpt2_lm", 4 - _rank(), 0)),  # dp=2: replica 1's
     ValueError, "Batch size 3 is not divisible|batch on rank 1 \\(data-parallel replica 1\\) cannot be split"),
    (lambda: _step(dict(tp_size=2, num_microbatches=2), _with(GOOD, "labels", (0, 1), 10 ** 6)), IndexError,
     "Label 1000000 on rank 0"),
    # sequence parallelism splits the sequence over tp: a length tp does not divide is refused on every rank
    (lambda: _step(dict(tp_size=2, num_microbatches=2, enable_sequence_parallelism=True),
                   {k: v[:, :7] for k, v in GOOD.items()}),
     ValueError, "Sequence length 7 on rank 0 \\(data-parallel replica 0\\) is not a multiple of 2: "
                 "enable_sequence_parallelism splits the sequence over tp_size=2 ranks \\(split_gather\\)"),
    # ring attention over a group of its own (tp=1): the message names sp_size and the 2 chunks per rank
    (lambda: _step(dict(sp_size=2, num_microbatches=2, enable_sequence_parallelism=True,
                        sequence_parallelism_mode="ring_attn"), {k: v[:, :6] for k, v in GOOD.items()}, "llama_lm"),
     ValueError, "Sequence length 6 on rank 0 .* is not a multiple of 4: enable_sequence_parallelism splits the "
                 "sequence over sp_size=2 ranks in 2 chunks each \\(ring_attn\\)"),
    (lambda: _forward(dict(tp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all"),
                      {k: v[:, :7] for k, v in GOOD.items()}),
     ValueError, "splits the sequence over tp_size=2 ranks, but this batch has sequence length 7: pad the batch"),
]


def _check_cases(cases):
    for make, exc, pattern in cases:
        try:
            with pytest.raises(exc, match=pattern):
                make() if callable(make) else HybridParallelPlugin(**make)
        except BaseException as failure:
            raise AssertionError(f"case expecting {exc.__name__}({pattern!r})") from failure
        dist.barrier()  # nobody is stuck in a collective: every rank raised the same error


def _check_zero_label_microbatch_under_tp():
    """One microbatch whose labels are all -100, tp=2: as in one process, its loss is nan but its gradients are zero,
    so the step moves every parameter exactly as the reference does (and nothing turns NaN). With a token-weighted
    loss it weighs nothing and the loss is the finite token mean of the whole batch."""
    batch = mu.make_batch("llama_lm", 4, 1)
    batch["labels"][:2] = -100  # microbatch 0 of 2 has no label token
    for weighted in (False, True):
        reference = mu.build("llama_lm")
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
        kwargs = dict(loss_weight_fn=causal_lm_label_tokens) if weighted else {}
        booster = Booster(plugin=HybridParallelPlugin(tp_size=2, num_microbatches=2, **kwargs))
        model = mu.build("llama_lm")
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6))
        if weighted:
            expected = reference(**batch).loss
        else:
            expected = mu.microbatch_mean_loss(reference, batch, 2)
        expected.backward()
        ref_opt.step()
        loss = booster.execute_pipeline(iter([batch]), model, mu.criterion, opt)["loss"]
        assert torch.isnan(loss) if not weighted else torch.isfinite(loss), loss
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-5, equal_nan=True)
        opt.step()
        for name, p in model.unwrap().named_parameters():
            full = mu.gathered(p, p.data, booster.plugin.tp_group)
            assert torch.isfinite(full).all(), f"{name} is not finite"
            mu.assert_close(full, reference.get_parameter(name).data, f"weighted={weighted}: {name} after AdamW")


def _check_replicas_made_identical_over_tp():
    """A model built with another seed on each tp rank: boost makes the replicated weights (norms, position
    embeddings) identical, so both tp ranks train one model."""
    torch.manual_seed(1000 + dist.get_rank())
    model, *_ = Booster(plugin=HybridParallelPlugin(tp_size=2)).boost(mu.MODELS["gpt2_lm"]())
    for name, p in model.unwrap().named_parameters():
        if mu.get_tp_spec(p) is None:
            parts = [torch.empty_like(p.data) for _ in range(2)]
            dist.all_gather(parts, p.data.contiguous())
            assert torch.equal(parts[0], parts[1]), f"replicated {name} differs between tp ranks"


def _check_evaluation_outputs_in_train_mode():
    """return_outputs=True gives what one process gives in train mode too: full, unpadded logits (a vocabulary of 101,
    all logits negative, so zero padding columns would win an argmax) and one loss for the step."""
    from transformers import GPT2LMHeadModel

    config = mu.gpt2_config()
    config.vocab_size = 101  # no tp size divides it: the vocab-parallel head pads
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(config)
    with torch.no_grad():  # logits = ones @ -|wte|: negative everywhere
        reference.transformer.ln_f.weight.zero_()
        reference.transformer.ln_f.bias.fill_(1.0)
        reference.transformer.wte.weight.copy_(-reference.transformer.wte.weight.abs() - 0.01)
    batch = mu.make_batch("gpt2_lm", 4, 2)
    for kwargs in (dict(tp_size=2, num_microbatches=2), dict(pp_size=2, num_microbatches=2)):
        booster = Booster(plugin=HybridParallelPlugin(**kwargs))
        model, *_ = booster.boost(copy.deepcopy(reference))
        model.train()
        with torch.no_grad():
            out = booster.execute_pipeline(iter([batch]), model, mu.criterion, return_outputs=True)
            expected = reference(**batch).logits
            expected_loss = mu.microbatch_mean_loss(reference, batch, 2)
        if booster.plugin.is_last_stage():
            logits = out["outputs"]["logits"]
            assert logits.shape == expected.shape, (kwargs, logits.shape)
            assert (expected < 0).all()
            mu.assert_close(logits, expected, f"{kwargs} logits in train mode")
            assert torch.equal(logits.argmax(-1), expected.argmax(-1))
            mu.assert_close(out["outputs"]["loss"], expected_loss, f"{kwargs} outputs.loss")
        else:
            assert out["outputs"] is None


def _check_nonfinite_gradients_skip_or_raise_everywhere():
    """An inf gradient on stage 1 only: every rank skips the step (no parameter changes, rank 0 warns naming the
    step and stage), or with on_nonfinite="raise" every rank raises; the next good step trains."""
    import warnings

    for mode in ("skip", "raise"):
        booster = Booster(plugin=HybridParallelPlugin(pp_size=2, num_microbatches=2, on_nonfinite=mode))
        model = mu.build("llama_lm")
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        before = {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}
        victim = next(p for p in model.unwrap().parameters())
        handle = victim.register_hook(lambda g: g * float("inf")) if booster.plugin.stage == 1 else None
        booster.execute_pipeline(iter([mu.make_batch("llama_lm", 4, 0)]), model, mu.criterion, opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode == "raise":
                with pytest.raises(FloatingPointError, match="optimizer step 1: non-finite .* stage\\(s\\) \\[1\\]"):
                    opt.step()
            else:
                assert opt.step() is None
        mine = [str(w.message) for w in caught if "non-finite" in str(w.message)]
        assert len(mine) == (1 if mode == "skip" and dist.get_rank() == 0 else 0), mine
        for n, p in model.unwrap().named_parameters():
            assert torch.equal(p.data, before[n]), f"{mode}: {n} changed in a skipped step"
        if handle is not None:
            handle.remove()
        booster.execute_pipeline(iter([mu.make_batch("llama_lm", 4, 1)]), model, mu.criterion, opt)
        opt.step()
        assert any(not torch.equal(p.data, before[n]) for n, p in model.unwrap().named_parameters())


def _check_dropped_models_are_freed():
    """A boosted model, its optimizer and booster that the program drops are freed, with their process groups (and
    so gloo's threads): nothing in a parameter's hooks keeps them alive (the garbage collector cannot see through
    tensor hooks)."""
    import gc
    import weakref

    for kwargs in (dict(), dict(zero_stage=1), dict(tp_size=2), dict(pp_size=2)):
        booster = Booster(plugin=HybridParallelPlugin(num_microbatches=2, **kwargs))
        model = mu.build("gpt2_lm")
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        booster.execute_pipeline(iter([mu.make_batch("gpt2_lm", 4, 0)]), model, mu.criterion, opt)
        opt.step()
        refs = [weakref.ref(x) for x in (model, model.unwrap(), opt, booster.plugin)]
        del booster, model, opt
        gc.collect()
        alive = [type(r()).__name__ for r in refs if r() is not None]
        assert not alive, f"{kwargs}: {alive} still alive after the program dropped them"


def _two_ranks():
    _check_dropped_models_are_freed()
    _check_cases(CONFIG_CASES)
    _check_cases(BOOST_CASES)
    _check_cases(STEP_CASES)
    assert len(CONFIG_CASES) + len(BOOST_CASES) + len(STEP_CASES) >= 40
    _check_zero_label_microbatch_under_tp()
    _check_replicas_made_identical_over_tp()
    _check_evaluation_outputs_in_train_mode()
    _check_nonfinite_gradients_skip_or_raise_everywhere()
    mu.check_training("gpt2_lm", tp_size=2, num_microbatches=2)  # the group still trains after all of the above
    mu.check_training("gpt2_lm", tp_size=2, zero_stage=1)  # ZeRO over dp size 1: runs as zero_stage=0 (ColossalAI)


def test_bad_input_and_silent_corruption_two_ranks():
    run_distributed(2, _two_ranks)



def _collective_on_one_rank(tmp_dir: str):
    """`if rank == 0: booster.save_model(...)` (a collective call on one rank) fails within the plugin's timeout
    with an error saying the call is collective, instead of hanging."""
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, timeout=3))
    model, *_ = booster.boost(mu.build("gpt2_lm"))
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match="save_model is collective: every rank must call it.*Ranks 1 failed"):
            booster.save_model(model, f"{tmp_dir}/model")
        assert not os.path.exists(f"{tmp_dir}/model")
    else:
        time.sleep(5)  # busy elsewhere, never calls save_model


def test_collective_call_on_one_rank_fails_within_timeout(tmp_path):
    run_distributed(2, _collective_on_one_rank, str(tmp_path), timeout=120, fresh=True)


def _collective_on_one_rank_default_timeout(tmp_dir: str):
    """With the default timeout (600 s, not torch's 30 minutes) the call still fails within the arrival window
    (ARRIVAL_TIMEOUT_S, 60 s; 2 s here), and the rank that never called it learns why at its next step."""
    from booster_plugin.plugins import hybrid as plugin_module
    from booster_plugin.guards.failure import RankFailure

    plugin_module.ARRIVAL_TIMEOUT_S = 2.0
    plugin = HybridParallelPlugin(tp_size=2, num_microbatches=2)
    assert plugin.timeout == 600.0
    booster = Booster(plugin=plugin)
    model, *_ = booster.boost(mu.build("gpt2_lm"))
    start = time.monotonic()
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match="save_model is collective.*within 2 s of the first"):
            booster.save_model(model, f"{tmp_dir}/model")
        assert time.monotonic() - start < 30
    else:
        time.sleep(8)  # busy elsewhere, never calls save_model (rank 0 fails at ~2 s, publishes at ~4 s)
        with pytest.raises(RankFailure, match="rank 0 failed in save_model"):
            booster.execute_pipeline(iter([mu.make_batch("gpt2_lm", 4, 0)]), model, mu.criterion)


def test_collective_call_on_one_rank_fails_fast_by_default(tmp_path):
    """In a world group without a CPU backend (as "nccl"): the arrival barrier runs on the library's gloo group."""
    run_distributed(2, _collective_on_one_rank_default_timeout, str(tmp_path), timeout=120, fresh=True,
                    backend="cuda:gloo")


FAILING_STEP = """
import time, torch, torch.distributed as dist
dist.init_process_group("cuda:gloo")  # as a GPU script's "nccl": a world group without a CPU backend
from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.guards.failure import RankFailure
from tests import model_utils as mu
torch.set_num_threads(1)
booster = Booster(plugin=HybridParallelPlugin(pp_size=2, num_microbatches=2))
model, *_ = booster.boost(mu.build("llama_lm"))
def criterion(outputs, batch):
    if calls["n"] == 1:
        raise ValueError("criterion boom")
    return outputs.loss
calls = {"n": 0}
booster.execute_pipeline(iter([mu.make_batch("llama_lm", 4, 0)]), model, criterion)  # a good step
calls["n"] = 1
started = time.monotonic()
try:
    booster.execute_pipeline(iter([mu.make_batch("llama_lm", 4, 1)]), model, criterion)
except ValueError as error:  # the last stage: the script catches its own error and tries to go on
    print(f"caught {error}", flush=True)
    try:
        booster.execute_pipeline(iter([mu.make_batch("llama_lm", 4, 2)]), model, criterion)
    except RankFailure as refused:
        print(f"refused: {refused}", flush=True)
print(f"returned after {time.monotonic() - started:.1f} s", flush=True)
"""


def _run_two_ranks(tmp_path, source: str):
    """Run `source` as a script on 2 ranks (fresh interpreters): [(returncode, stdout, stderr)] per rank."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.dist_utils import _free_port

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "fail.py"
    script.write_text(source)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=root, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def test_failure_on_one_stage_ends_the_step_on_every_rank(tmp_path):
    """The criterion raises on the last stage (rank 1) while stage 0 waits for its gradients: rank 0 exits within
    seconds naming rank 1's error (instead of waiting for gloo's 30-minute timeout), rank 1 raises its own error and
    refuses the next step."""
    (code0, out0, err0), (code1, out1, err1) = _run_two_ranks(tmp_path, FAILING_STEP)
    assert code0 == 1, (out0, err0[-2000:])
    # blocked in a receive: the watchdog ends it; or its receive failed when rank 1 exited: RankFailure names rank 1
    assert re.search(r"(stopping: |RankFailure: The job cannot continue: )rank 1 failed in execute_pipeline: "
                     r"ValueError: criterion boom", err0), err0[-2000:]
    assert code1 == 0, (out1, err1[-2000:])
    assert "caught criterion boom" in out1 and "refused: The job cannot continue: rank 1 failed" in out1, out1


FROZEN_RANK = """
import os, signal, torch, torch.distributed as dist
from booster_plugin import Booster, HybridParallelPlugin
from tests import model_utils as mu
torch.set_num_threads(1)
booster = Booster(plugin=HybridParallelPlugin(pp_size=2, num_microbatches=2))
model, *_ = booster.boost(mu.build("llama_lm"))
booster.execute_pipeline(iter([mu.make_batch("llama_lm", 4, 0)]), model, mu.criterion)  # a good step
print("stepped", flush=True)
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen: no error, no closed connection
booster.execute_pipeline(iter([mu.make_batch("llama_lm", 4, 1)]), model, mu.criterion)
"""


def test_frozen_rank_is_named_within_the_bound(tmp_path):
    """Rank 1 stops (SIGSTOP) between steps: rank 0, waiting for it in the next step, stops within the bound
    (HYBRID_PARALLEL_FROZEN_RANK_S, 4 s here) naming rank 1, instead of waiting out the 600 s timeout."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.dist_utils import _free_port

    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "frozen.py"
    script.write_text(FROZEN_RANK)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), "HYBRID_PARALLEL_FROZEN_RANK_S": "4"}
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=root, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        out0, err0 = procs[0].communicate(timeout=120)
    finally:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].communicate()
    assert "stepped" in out0 and procs[0].returncode == 1, (out0, err0[-2000:])
    assert re.search(r"stopping: rank 1 stopped responding: no heartbeat for \d+ s while rank 0 waited", err0), \
        err0[-2000:]
