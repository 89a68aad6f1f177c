"""Families transformers gives no plan (OPT; ViT: ViTModel, image classification, masked image modeling: inferred
from their structure; BLOOM, Falcon in its three attention layouts: hand-written, their fused query_key_value
interleaving heads) train exactly under tp=2 x pp=2, every such policy proven by one forward of a small twin at boost;
GPT-J (which declares plans in transformers 5) trains exactly with the plan inferred from its structure instead,
which equals its declared one; a wrong plan is refused by the proof, naming the module."""
import pytest
import torch
from transformers import (BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM, GPTJConfig, GPTJForCausalLM,
                          GPTNeoXJapaneseConfig, GPTNeoXJapaneseForCausalLM, OPTForCausalLM,
                          OPTForSequenceClassification, ViTConfig, ViTForImageClassification,
                          ViTForMaskedImageModeling, ViTModel)

from hp_check.tiny import tiny_config
from shardformer.policies import PlanRefused, PlanSource, TransformersPlanPolicy, choose_policy, get_autopolicy
from shardformer.policies.bloom import BloomPolicy
from shardformer.policies.falcon import FalconPolicy
from shardformer.policies.inferred import InferredPolicy, infer_policy
from shardformer.stage.forward import SHAPED
from shardformer.tensor.styles import Colwise
from shardformer.image_batches import image_batch
from tests import model_utils as mu
from tests.dist_utils import run_distributed

V = mu.VOCAB


def _bloom(n):
    return BloomForCausalLM(BloomConfig(vocab_size=V, hidden_size=32, n_layer=n, n_head=4, pad_token_id=0))


def _falcon(n, new=False, multi_query=False):
    """Falcon-40B's layout (new: grouped key/value, rotary), the old one with ALiBi, or Falcon-7B's (transformers'
    default: multi-query, rotary)."""
    return FalconForCausalLM(FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=n, num_attention_heads=4,
                                          num_kv_heads=2 if new else 4, new_decoder_architecture=new,
                                          multi_query=multi_query, ffn_hidden_size=64, pad_token_id=0,
                                          alibi=not (new or multi_query)))


def _gptj(n):
    return GPTJForCausalLM(GPTJConfig(vocab_size=V, n_positions=32, n_embd=32, n_layer=n, n_head=4, rotary_dim=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0))


def _vit(cls, n):
    return cls(ViTConfig(hidden_size=32, num_hidden_layers=n, num_attention_heads=4, intermediate_size=64,
                         image_size=8, patch_size=2, encoder_stride=2, num_labels=3, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0))


VIT = {"vit": ViTModel, "vit_cls": ViTForImageClassification, "vit_mim": ViTForMaskedImageModeling}
BUILDERS = {
    "opt_inferred_lm": lambda n=4: OPTForCausalLM(mu.opt_config(n)),
    "opt_inferred_cls": lambda n=4: OPTForSequenceClassification(mu.opt_config(n)),
    "gptj_inferred_lm": lambda n=4: _gptj(n),
    "bloom_lm": lambda n=4: _bloom(n),
    "falcon_lm": lambda n=4: _falcon(n, new=False),
    "falcon_new_lm": lambda n=4: _falcon(n, new=True),
    "falcon_mq_lm": lambda n=4: _falcon(n, multi_query=True),
    **{kind: lambda n=4, c=cls: _vit(c, n) for kind, cls in VIT.items()},
}
mu.MODELS.update(BUILDERS)
for _kind in VIT:  # images of 4 x 4 patches with a class each (classification) or masked patches (masked modeling)
    mu.BATCHES[_kind] = lambda b, s, k=_kind: image_batch(mu.build(k, 1), b, torch.Generator().manual_seed(s))


def test_policy_sources():
    """Which path each family takes (no ranks needed)."""
    for kind, source in (("opt_inferred_lm", InferredPolicy), ("opt_inferred_cls", InferredPolicy),
                         ("bloom_lm", BloomPolicy), ("falcon_lm", FalconPolicy), ("vit_mim", InferredPolicy)):
        assert type(get_autopolicy(mu.build(kind, 2))) is source, kind
    # ViT: its patch embeddings (pixels -> patches) stand as zeros of their output's shape off the first stage
    vit = get_autopolicy(mu.build("vit_cls", 2))
    assert (vit.layers, vit.entry, vit.exit) == ("layers", {"embeddings": SHAPED}, ("layernorm",))
    # the path that picked it, as the coverage table reports it
    for kind, source, described in (("llama_lm", PlanSource.TRANSFORMERS, "transformers (TransformersPlanPolicy)"),
                                    ("opt_inferred_lm", PlanSource.INFERRED, "inferred (InferredPolicy)"),
                                    ("bert_mlm", PlanSource.HAND_WRITTEN, "hand-written (BertPolicy)")):
        choice = choose_policy(mu.build(kind, 2))
        assert (choice.source, choice.describe()) == (source, described), kind
    # a fused projection whose head layout the structure does not tell: refused, with the reason
    japanese = GPTNeoXJapaneseForCausalLM(tiny_config(GPTNeoXJapaneseConfig, num_hidden_layers=2))
    with pytest.raises(PlanRefused, match=r"Nor can a plan be inferred.*'layers\.0\.attention\.query_key_value' "
                                          r"does not say whether its heads are interleaved"):
        get_autopolicy(japanese)


# the plans transformers declares for GPT-J (5.24: GPTJConfig.base_model_*_plan, GPTJForCausalLM._*_plan); releases
# before (5.17) declare none, so there the test compares the inferred plan with these
GPTJ_PLANS = ({"transformer.wte": (["input_ids"], ["inputs_embeds"]),
               "transformer.drop": (["inputs_embeds"], ["hidden_states"]),
               "transformer.h": (["hidden_states", "attention_mask"], ["hidden_states"]),
               "transformer.ln_f": (["hidden_states"], ["hidden_states"]), "lm_head": (["hidden_states"], ["logits"])},
              {"transformer.wte": "embedding_rowwise", "transformer.h.*.attn.q_proj": "colwise",
               "transformer.h.*.attn.k_proj": "colwise", "transformer.h.*.attn.v_proj": "colwise",
               "transformer.h.*.attn.out_proj": "rowwise", "transformer.h.*.mlp.fc_in": "colwise",
               "transformer.h.*.mlp.fc_out": "rowwise", "lm_head": "colwise_gather_output"})


def test_inferred_equals_declared_plan():
    """GPT-J declares plans: the plan inferred from its structure is the same (tp entries, layers, entry, exit)."""
    model = mu.build("gptj_inferred_lm", 2)
    if GPTJConfig.base_model_tp_plan:  # the release's own plans, which GPTJ_PLANS copies
        assert (model._pp_plan, model._tp_plan) == GPTJ_PLANS
        declared = TransformersPlanPolicy(model)
    else:
        declared = TransformersPlanPolicy(model, plans=GPTJ_PLANS)
    inferred = infer_policy(model)
    assert inferred.tp_plan == declared.tp_plan and inferred.head_tp_plan == declared.head_tp_plan
    assert (inferred.layers, inferred.entry, inferred.exit) == (declared.layers, declared.entry, declared.exit)


# split_gather sequence parallelism too: BLOOM's attention reads the query length from its input (a tp region
# gathers it), OPT flattens its MLP's input to [tokens, hidden]
SPLIT_GATHER = ("bloom_lm", "falcon_lm", "falcon_new_lm", "opt_inferred_lm", "gptj_inferred_lm")


def _train(kind):
    policy = infer_policy(mu.build(kind, 2)) if kind == "gptj_inferred_lm" else None  # (GPT-J declares plans)
    mu.check_training(kind, steps=1, layers=4, tp_size=2, pp_size=2, num_microbatches=2, custom_policy=policy)
    if kind in SPLIT_GATHER:
        mu.check_training(kind, steps=1, layers=4, tp_size=2, pp_size=2, num_microbatches=2, custom_policy=policy,
                          enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather")


@pytest.mark.parametrize("kind", list(BUILDERS))
def test_exact_at_tp2_pp2(kind):
    run_distributed(4, _train, kind)


class _WrongOPT(InferredPolicy):
    """OPT's inferred plan with v_proj split as two fused areas: a wrong layout of its heads."""


def _refused():
    model = mu.build("opt_inferred_lm", 4)
    policy = get_autopolicy(model)
    wrong = _WrongOPT(**{k: getattr(policy, k) for k in ("layers", "entry", "exit", "head_tp_plan", "tp_attributes",
                                                           "tp_input_regions", "local_rng_modules")},
                      tp_plan={**policy.tp_plan, "decoder.layers.*.self_attn.v_proj": Colwise(n_fused=2)})
    with pytest.raises(PlanRefused, match=r"output of 'model\.decoder\.layers\.0\.self_attn\.out_proj'.* differs"):
        mu.check_training("opt_inferred_lm", steps=1, tp_size=2, pp_size=2, num_microbatches=2, custom_policy=wrong)


def test_wrong_plans_refused_naming_the_module():
    run_distributed(4, _refused)
