"""Usage mistakes are refused before anything runs, the same way on every rank, naming the problem and the fix: a
pipeline stage called to train outside `execute_pipeline` (`model(**batch)`), wrong `execute_pipeline` arguments,
empty batches, float labels, a model boosted twice, a typo in a custom policy's plan, LoRA's `modules_to_save` on a
tp-sharded head (under pp alone it trains like peft), a criterion returning a non-scalar. Evaluation in eval mode
without an optimizer runs forwards only, without `torch.no_grad()`."""
import copy
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.core.stage_calls import PipelineCallError
from shardformer.tensor.lora_sharding import LoRAShardingError
from shardformer.policies import Colwise
from tests import model_utils as mu
from tests.dist_utils import run_distributed
from tests.test_custom_policy import OPTPolicy

BATCH = mu.make_batch("gpt2_lm", 4, 0)
PROMPT = BATCH["input_ids"][:1, :4]
TRAINING_CALL = ("Under pipeline parallelism \\(pp_size=2\\) each rank holds one stage of the model: a direct call "
                 ".* runs as one pipelined forward only to evaluate .*booster.execute_pipeline")


class Boosted(NamedTuple):
    booster: Booster
    model: Any
    optimizer: Any


def _boost(kind: str = "gpt2_lm", model=None, **plugin_kwargs) -> Boosted:
    booster = Booster(plugin=HybridParallelPlugin(**plugin_kwargs))
    model = model if model is not None else mu.build(kind)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return Boosted(booster, boosted, optimizer)


def _step(b: Boosted, batch=BATCH, criterion=mu.criterion, optimizer="boosted", model=None):
    optimizer = b.optimizer if optimizer == "boosted" else optimizer
    return b.booster.execute_pipeline(iter([batch]), b.model if model is None else model, criterion, optimizer)


def _boost_twice(**plugin_kwargs):
    model = mu.build("gpt2_lm")
    _boost(model=model, **plugin_kwargs)
    _boost(model=model, **plugin_kwargs)


def _with_plan(pattern: str, style):
    """OPTPolicy with its q_proj entry replaced by `pattern: style`."""
    q_proj = "decoder.layers.*.self_attn.q_proj"
    plan = [(pattern, style) if k == q_proj else (k, v) for k, v in OPTPolicy.tp_plan.items()]
    policy = type("OPTTypoPolicy", (OPTPolicy,), {"tp_plan": dict(plan)})()
    return _boost("opt_lm", tp_size=2, custom_policy=policy)


def _lora(**plugin_kwargs):
    from peft import LoraConfig

    booster = Booster(plugin=HybridParallelPlugin(**plugin_kwargs))
    model = booster.enable_lora(mu.build("llama_lm"), lora_config=LoraConfig(r=4, target_modules=["q_proj"],
                                                                              modules_to_save=["lm_head"]))
    return booster.boost(model)


def _float_labels(batch):
    return {**batch, "labels": batch["labels"].float()}


def _empty(batch, rows=None, length=None):
    return {k: v[:rows, :length] for k, v in batch.items()}


def _cases(pp: Boosted, tp: Boosted):
    """(make, exception, message pattern) on 2 ranks; `pp`: pp=2, `tp`: tp=2 with microbatches."""
    return [
        # a training call of a pipeline stage: both ranks raise, naming execute_pipeline (evaluation calls and
        # generate run pipelined: tests/test_pipeline_generate.py)
        (lambda: pp.model(**BATCH), PipelineCallError, TRAINING_CALL),
        (lambda: pp.model.unwrap()(**BATCH), PipelineCallError, TRAINING_CALL),
        # execute_pipeline's arguments
        (lambda: _step(pp, criterion=pp.optimizer, optimizer=None), TypeError,
         "got the optimizer \\(HybridParallelOptimizer\\) as its criterion: pass the criterion before the optimizer"),
        (lambda: _step(pp, criterion=None), ValueError, "trains here .* which needs a loss: pass criterion="),
        (lambda: _step(pp, criterion="loss"), TypeError, "criterion must be callable as criterion\\(outputs, micro"),
        (lambda: _step(pp, optimizer=torch.optim.SGD(pp.model.parameters(), lr=0.1)), TypeError,
         "needs the optimizer booster.boost returned .*, got SGD"),
        (lambda: _step(pp, model=mu.build("gpt2_lm")), TypeError,
         "needs the model booster.boost returned, got GPT2LMHeadModel: call `model, optimizer, \\*_ = booster.boost"),
        # the batch
        (lambda: _step(pp, _empty(BATCH, rows=0)), ValueError, "The batch is empty: 'input_ids' has shape \\(0, 8\\)"),
        (lambda: _step(pp, _empty(BATCH, length=0)), ValueError,
         "The batch is empty: 'input_ids' has shape \\(4, 0\\)"),
        (lambda: _step(pp, _float_labels(BATCH)), TypeError,
         "labels have dtype torch.float32, but this model's labels are token ids .* labels.long\\(\\)"),
        (lambda: _step(tp, _float_labels(BATCH)), TypeError, "labels have dtype torch.float32"),
        # boost
        (lambda: _boost_twice(tp_size=2), ValueError, "This GPT2LMHeadModel object was boosted before: boost shards"),
        (lambda: _boost_twice(pp_size=2, num_microbatches=2), ValueError, "was boosted before"),
        (lambda: _with_plan("decoder.layers.*.self_attn.q_prj", Colwise()), ValueError,
         "OPTTypoPolicy.tp_plan\\['decoder.layers.\\*.self_attn.q_prj'\\] matches no module or parameter of OPTModel; "
         "'decoder.layers.0.self_attn' has \\['k_proj', 'v_proj', 'q_proj', 'out_proj'\\]"),
        (lambda: _with_plan("decoder.layers.*.self_attn.q_proj", Colwise), TypeError,
         "tp_plan\\['decoder.layers.\\*.self_attn.q_proj'\\] is the class Colwise, not a parallel style"),
        # ranks that built different models: both raise at boost, before any shard (3 vs 4 layers; a config value)
        (lambda: _boost(model=mu.build("gpt2_lm", layers=3 + dist.get_rank()), tp_size=2), ValueError,
         "The ranks built different models \\(parameters: rank 0 has 41, rank 1 has 53, .*build the same model"),
        (lambda: _boost(model=_with_config(layer_norm_epsilon=1e-5 * (1 + dist.get_rank())), pp_size=2,
                        num_microbatches=2), ValueError,
         "The ranks built different models \\(config \\(digest\\): rank 0 has -?[0-9]+, rank 1 has"),
        (lambda: _lora(tp_size=2), LoRAShardingError,
         "modules_to_save wraps 'lm_head' .* tensor parallelism shards 'lm_head' as VocabHead.* or use tp_size=1"),
    ]


def _with_config(**changes):
    config = mu.gpt2_config()
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return type(mu.build("gpt2_lm"))(config)


def _check_cases(cases):
    for make, exc, pattern in cases:
        try:
            with pytest.raises(exc, match=pattern):
                make()
        except BaseException as failure:
            raise AssertionError(f"case expecting {exc.__name__}({pattern!r})") from failure
        dist.barrier()  # nobody is stuck in a collective: every rank raised the same error


def _check_eval_mode_runs_forwards_only():
    """model.eval() and no optimizer, without torch.no_grad(): forwards only (no parameter gets a gradient), the
    same loss and outputs as under no_grad; the next training step still equals one process."""
    reference = mu.build("gpt2_lm")
    b = _boost(model=copy.deepcopy(reference), pp_size=2, num_microbatches=2)
    b.model.eval()
    out = b.booster.execute_pipeline(iter([BATCH]), b.model, mu.criterion, return_outputs=True)
    held = [n for n, p in b.model.unwrap().named_parameters() if p.grad is not None]
    assert not held, f"evaluation produced gradients for {held}"
    with torch.no_grad():
        expected = b.booster.execute_pipeline(iter([BATCH]), b.model, mu.criterion, return_outputs=True)
    assert torch.equal(out["loss"], expected["loss"])
    if b.booster.plugin.is_last_stage():
        assert torch.equal(out["outputs"].logits, expected["outputs"].logits)
    b.model.train()
    loss = _step(b)["loss"]
    ref_loss = mu.microbatch_mean_loss(reference, BATCH, 2)
    ref_loss.backward()
    mu.assert_close(loss, ref_loss.detach(), "training loss after evaluation")
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in b.model.unwrap().named_parameters():
        mu.assert_close(p.grad, ref_params[name].grad, f"gradient of {name} after evaluation")


def _check_tp_generation_still_works():
    """pp_size=1, tp=2: the model is whole on every rank, and greedy generation equals one process."""
    reference = mu.build("gpt2_lm").eval()
    b = _boost(model=copy.deepcopy(reference), tp_size=2)
    b.model.eval()
    with torch.no_grad():
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(b.model.unwrap().generate(PROMPT, **kwargs), reference.generate(PROMPT, **kwargs))


def _check_modules_to_save_trains_under_pp():
    """LoRA with modules_to_save=["lm_head"] under pp alone (no tp plan applies): the loss and the gradients of the
    adapters and of the head's trainable copy equal single-process peft."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], init_lora_weights=False)
    base = mu.build("llama_lm")
    torch.manual_seed(1)
    reference = get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
    booster = Booster(plugin=HybridParallelPlugin(pp_size=2, num_microbatches=2))
    model = booster.enable_lora(base, lora_config=config)
    model.load_state_dict(reference.state_dict())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt, *_ = booster.boost(model, opt)
    loss = booster.execute_pipeline(iter([mu.make_batch("llama_lm", 4, 0)]), model, mu.criterion, opt)["loss"]
    ref_loss = mu.microbatch_mean_loss(reference, mu.make_batch("llama_lm", 4, 0), 2)
    ref_loss.backward()
    mu.assert_close(loss, ref_loss.detach(), "modules_to_save loss")
    ref_params = dict(reference.get_base_model().named_parameters(remove_duplicate=False))
    trained = [(n, p) for n, p in model.unwrap().named_parameters() if p.requires_grad]
    assert any("modules_to_save" in n for n, _ in trained) == booster.plugin.is_last_stage()
    for name, p in trained:
        mu.assert_close(p.grad, ref_params[name].grad, f"modules_to_save: gradient of {name}")


def _check_nonscalar_criterion():
    """A criterion returning a non-scalar is known only on the last stage, mid-step: it raises there naming the shape
    (tp=2: both ranks are the last stage). Last: the failure guard then refuses every later step of this group."""
    tp = _boost(tp_size=2, num_microbatches=2)
    with pytest.raises(TypeError, match="must return the microbatch's loss as a scalar tensor; it returned a tensor "
                                        "of shape \\(2, 8\\): reduce it in the criterion"):
        _step(tp, criterion=lambda outputs, batch: outputs.loss.expand(2, 8))


def _two_ranks():
    pp, tp = _boost(pp_size=2, num_microbatches=2), _boost(tp_size=2, num_microbatches=2)
    _check_cases(_cases(pp, tp))
    _check_eval_mode_runs_forwards_only()
    _check_tp_generation_still_works()
    _check_modules_to_save_trains_under_pp()
    _step(pp)  # the group still trains after all of the above
    _check_nonscalar_criterion()


def test_usage_errors_two_ranks():
    run_distributed(2, _two_ranks)


def test_vocab_parallel_loss_refuses_float_labels():
    """A direct call under tp (no execute_pipeline) reaches the vocab-parallel loss, which refuses float labels before
    its first collective (torch's gather would fail with 'Expected dtype int32/int64 for index')."""
    from shardformer.layer.loss import vocab_parallel_cross_entropy

    with pytest.raises(TypeError, match="labels have dtype torch.float32, but the vocab-parallel cross-entropy takes "
                                        "token ids: pass integer labels"):
        vocab_parallel_cross_entropy(torch.randn(6, 10), torch.ones(6), None, 0)


def test_config_digest_ignores_nested_key_order():
    """A config that builds a nested dict from a set (order follows each process's hash seed) digests alike."""
    import json

    from booster_plugin.plugins.usage_checks import _canonical
    one = {"rope_parameters": {"sliding": {"theta": 1}, "full": {"theta": 2}}, "id2label": {0: "a", 1: "b"}}
    two = {"id2label": {1: "b", 0: "a"}, "rope_parameters": {"full": {"theta": 2}, "sliding": {"theta": 1}}}
    assert json.dumps(_canonical(one)) == json.dumps(_canonical(two))
    assert json.dumps(_canonical(one)) != json.dumps(_canonical({**one, "id2label": {0: "a", 1: "c"}}))
