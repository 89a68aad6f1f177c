"""Direct calls under pipeline parallelism (shardformer/stage/pipelined_call.py): a call every rank makes alike to
evaluate (`model(**batch)`, `model.unwrap()(**batch)`, `model.unwrap().generate(...)`) runs as one pipelined forward
and returns on every rank what the unsharded model returns in one process: logits and loss at 1e-5 (fp32), and the
same tokens from greedy, seeded sampling and beam search generation (left padding, eos, the KV cache filled stage by
stage), at pp=2 (dp=2), tp=2 x pp=2 and pp=4 in one 4-rank launch: Llama, GPT-2, Qwen2 with sliding-window layers, a
Qwen3 MoE with its load-balancing loss, a LoRA model. Calls it cannot run are refused on every rank."""
import copy

import pytest
import torch
import torch.distributed as dist
import transformers

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.core.stage_calls import PipelineCallError
from tests import model_utils as mu
from tests.dist_utils import run_distributed
from tests import test_expert_parallel, test_multimodal  # noqa: F401  (register qwen3moe_lm, llava)
from tests.test_encoder_decoder import t5_config  # noqa: F401  (registers t5_lm)

# full attention and a sliding window of 3 tokens, alternating: at pp=2 the second stage holds neither layer 0 nor
# a full-attention layer first, so its masks' lengths come from the right layer of its own (StageCache)
mu.MODELS["qwen2_sliding_lm"] = lambda n=4: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
    vocab_size=mu.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=n, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32, use_sliding_window=True, sliding_window=3,
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"][:n], pad_token_id=0))
SP = dict(enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather")
LAYOUTS = {"llama_lm": (dict(pp_size=2), dict(tp_size=2, pp_size=2), dict(tp_size=2, pp_size=2, **SP),
                        dict(pp_size=4)),  # (middle stages: receive, send on, and the head's broadcast)
           "gpt2_lm": (dict(pp_size=2), dict(tp_size=2, pp_size=2)),
           "qwen2_sliding_lm": (dict(pp_size=2),),
           "qwen3moe_lm": (dict(pp_size=2),)}  # with its load-balancing loss (output_router_logits=True)


def _boost(reference, **plugin_kwargs):
    plugin = HybridParallelPlugin(**{"num_microbatches": plugin_kwargs.get("pp_size", 2), **plugin_kwargs})
    model, *_ = Booster(plugin=plugin).boost(copy.deepcopy(reference))
    return model


def _prompt(kind: str):
    """Two prompts of 5 tokens, the first left-padded by 2."""
    ids = mu.make_batch(kind, 2, 3)["input_ids"][:, :5].clone()
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    return ids, mask


def _same_tokens(reference, model, what: str, seed=None, **kwargs) -> torch.Tensor:
    outputs = []
    for m in (reference, model.unwrap()):
        if seed is not None:
            torch.manual_seed(seed)
        outputs.append(m.generate(**kwargs, pad_token_id=0))
    assert torch.equal(outputs[1], outputs[0]), (what, outputs[1], outputs[0])
    return outputs[0]


def _check_calls(reference, model, kind: str) -> None:
    """Eval logits and loss of both direct calls, then generation, against the unsharded model."""
    reference.eval(), model.eval()
    batch = mu.make_batch(kind, 2, 4)
    with torch.no_grad():
        expected = reference(**batch)
        for call in (model, model.unwrap()):
            out = call(**batch)
            mu.assert_close(out.logits, expected.logits, f"{kind} logits")
            mu.assert_close(out.loss, expected.loss, f"{kind} loss")
    ids, mask = _prompt(kind)
    prompt = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5)
    greedy = _same_tokens(reference, model, f"{kind} greedy", **prompt, do_sample=False)
    eos = int(greedy[1, 7])  # the second row's third new token: it stops there, the first row goes on
    _same_tokens(reference, model, f"{kind} eos", **prompt, do_sample=False, eos_token_id=eos)
    _same_tokens(reference, model, f"{kind} sampling", seed=11, **prompt, do_sample=True, top_k=0)
    _same_tokens(reference, model, f"{kind} beam search", **prompt, do_sample=False, num_beams=2)


def _check_eval_calls(kind: str) -> None:
    """Heads other than a causal LM's (masked LM, sequence classification: the logits of each row's last token) give
    one process's logits and loss."""
    reference = mu.build(kind).eval()
    model = _boost(reference, pp_size=2).eval()
    batch = mu.make_batch(kind, 2, 4)
    with torch.no_grad():
        expected, out = reference(**batch), model(**batch)
    mu.assert_close(out.logits, expected.logits, f"{kind} logits")
    mu.assert_close(out.loss, expected.loss, f"{kind} loss")


def _check_train_mode_without_grad(reference, model, kind: str) -> None:
    """GRPO-style: train mode under no_grad (the chunked causal-LM loss stays off: full logits, the model's loss)."""
    reference.train(), model.train()
    batch = mu.make_batch(kind, 2, 5)
    with torch.no_grad():
        expected, out = reference(**batch), model(**batch)
    mu.assert_close(out.logits, expected.logits, f"{kind} train-mode logits")
    mu.assert_close(out.loss, expected.loss, f"{kind} train-mode loss")
    ids, mask = _prompt(kind)
    _same_tokens(reference, model, f"{kind} train-mode sampling", seed=5, input_ids=ids, attention_mask=mask,
                 max_new_tokens=4, do_sample=True)


def _check_lora_generates() -> None:
    """A LoRA model (peft) generates through the PeftModel as in one process."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    base = mu.build("llama_lm")
    torch.manual_seed(1)
    reference = get_peft_model(copy.deepcopy(base), copy.deepcopy(config)).eval()
    booster = Booster(plugin=HybridParallelPlugin(pp_size=2, num_microbatches=2))
    model = booster.enable_lora(base, lora_config=config)
    model.load_state_dict(reference.state_dict())
    model, *_ = booster.boost(model)
    model.eval()
    ids, mask = _prompt("llama_lm")
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected, actual = reference.generate(**kwargs), model.unwrap(unwrap_peft=False).generate(**kwargs)
    assert torch.equal(actual, expected), ("LoRA greedy", actual, expected)


def _refused(make, pattern: str, error=PipelineCallError) -> None:
    with pytest.raises(error, match=pattern):
        make()
    dist.barrier()  # nobody is stuck in a collective: every rank raised


def _check_refusals(reference, model) -> None:
    ids, mask = _prompt("llama_lm")
    batch = mu.make_batch("llama_lm", 2, 4)
    model.train()
    _refused(lambda: model(**batch), "runs as one pipelined forward only to evaluate.*booster.execute_pipeline")
    _refused(lambda: model.unwrap()(**batch), "only to evaluate")
    model.eval()
    with torch.no_grad():
        _refused(lambda: model(**batch, output_hidden_states=True), "output_hidden_states=True asks for every layer")
        # inputs are agreed on first: a bad id, or stages given different prompts, raise alike on every rank
        _refused(lambda: model(**{**batch, "input_ids": batch["input_ids"].clone().fill_(mu.VOCAB)}),
                 "Token id 100 on rank [0-9] .* is outside the vocabulary", IndexError)
        _refused(lambda: model(**mu.make_batch("llama_lm", 2, 4 + model.stage)), "got different batches", ValueError)
    torch.manual_seed(model.stage)  # the stages sample different tokens: the next forward's agreement raises
    _refused(lambda: model.unwrap().generate(input_ids=ids, max_new_tokens=4, do_sample=True, pad_token_id=0),
             "different contents of \\['input_ids'\\].*seed the global RNG alike", ValueError)
    _refused(lambda: model.unwrap().generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0,
                                             cache_implementation="static"),
             "the cache is a StaticCache.*DynamicCache")
    interleaved = _boost(reference, pp_size=2, pp_style="interleaved", num_model_chunks=2).eval()
    _refused(lambda: interleaved.unwrap().generate(input_ids=ids, max_new_tokens=2, pad_token_id=0),
             "several model chunks.*pp_style='1f1b'")
    t5 = _boost(mu.build("t5_lm", 2), pp_size=2).eval()
    llava = _boost(mu.build("llava", 4), pp_size=2).eval()
    with torch.no_grad():
        _refused(lambda: t5(**mu.make_batch("t5_lm", 2, 1)), "T5ForConditionalGeneration is split by its policy")
        _refused(lambda: llava(**mu.make_batch("llava", 2, 1)),
                 "LlavaForConditionalGeneration takes inputs only its first stage reads \\(pixel_values")


def check_direct_calls(kind: str, reference=None, **layout):
    """Eval calls and generation of `kind` boosted with `layout` (pp > 1) equal the unsharded model's; the boosted
    model (also run in the world shaped as NCCL's, test_world_groups.py)."""
    reference = reference if reference is not None else mu.build(kind)
    model = _boost(reference, **layout)
    _check_calls(reference, model, kind)
    return model


def _four_ranks() -> None:
    for kind, layouts in LAYOUTS.items():
        reference = mu.build(kind)
        for layout in layouts:
            model = check_direct_calls(kind, reference, **layout)
            if "enable_sequence_parallelism" not in layout:  # (train mode splits the sequence: generate in eval)
                _check_train_mode_without_grad(reference, model, kind)
            if kind == "llama_lm" and "tp_size" not in layout:
                _check_refusals(reference, model)
    _check_lora_generates()
    for kind in ("bert_mlm", "llama_cls"):
        _check_eval_calls(kind)


def test_direct_calls_and_generate_under_pipeline_parallelism():
    run_distributed(4, _four_ranks)
