"""Models described only by Parallelformers-style policies (GPT-2: fused q|k|v in reversed Conv1D weights; OPT:
plain Linear layers) train exactly like the unsharded model under tp, pp and tp × pp; the pipeline split is
derived from the model; wrong policies are refused with errors that name the fix.
(`four_ranks` runs in tests/test_seeds.py, one process group for all three files.)"""
import pytest
from transformers.models.bart.modeling_bart import BartDecoderLayer, BartEncoderLayer
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.opt.modeling_opt import OPTDecoderLayer

from shardformer.policies.from_parallelformers import (Layer, ParallelformersPolicy as Policy, TranslatedPolicy,
                                                       as_policy)
from shardformer.policies.base import Colwise, Rowwise
from tests import model_utils as mu
from tests.test_encoder_decoder import bart_config  # noqa: F401  (registers the "bart_lm" builder)
from tests.readme_blocks import readme_block


_README: dict = {}
exec(readme_block("### Another model, Parallelformers' way"), _README)  # the README's worked example
GPT2BlockPolicy = _README["GPT2BlockPolicy"]


class OPTLayerPolicy(Policy):
    @staticmethod
    def replace_arguments(config, world_size):
        return {"self_attn.num_heads": config.num_attention_heads // world_size}

    @staticmethod
    def attn_qkv():
        return [Layer(weight=f"self_attn.{x}_proj.weight", bias=f"self_attn.{x}_proj.bias") for x in "qkv"]

    @staticmethod
    def attn_out():
        return [Layer(weight="self_attn.out_proj.weight", bias="self_attn.out_proj.bias")]

    @staticmethod
    def mlp_in():
        return [Layer(weight="fc1.weight", bias="fc1.bias")]

    @staticmethod
    def mlp_out():
        return [Layer(weight="fc2.weight", bias="fc2.bias")]

    @staticmethod
    def original_layer_class():
        return OPTDecoderLayer


class BartEncoderLayerPolicy(Policy):  # a list of block policies: encoder and decoder layers
    @staticmethod
    def replace_arguments(config, world_size):
        return {"self_attn.num_heads": config.encoder_attention_heads // world_size,
                "encoder_attn.num_heads": config.decoder_attention_heads // world_size}

    @staticmethod
    def attn_qkv():
        return [Layer(weight=f"{a}.{x}_proj.weight", bias=f"{a}.{x}_proj.bias", ignore_checker=a == "encoder_attn")
                for a in ("self_attn", "encoder_attn") for x in "qkv"]

    @staticmethod
    def attn_out():
        return [Layer(weight=f"{a}.out_proj.weight", bias=f"{a}.out_proj.bias", ignore_checker=a == "encoder_attn")
                for a in ("self_attn", "encoder_attn")]

    @staticmethod
    def mlp_in():
        return [Layer(weight="fc1.weight", bias="fc1.bias")]

    @staticmethod
    def mlp_out():
        return [Layer(weight="fc2.weight", bias="fc2.bias")]

    @staticmethod
    def original_layer_class():
        return BartEncoderLayer


class BartDecoderLayerPolicy(BartEncoderLayerPolicy):
    @staticmethod
    def original_layer_class():
        return BartDecoderLayer


def test_translation_is_the_hand_written_policy():
    """The translated plan and the derived split are what a hand-written policy says (GPT2Policy, README's OPT)."""
    from shardformer.policies.gpt2 import GPT2Policy

    policy = as_policy(GPT2BlockPolicy)
    policy.set_model(mu.build("gpt2_lm"))
    assert policy.tp_plan == {k: v for k, v in GPT2Policy.tp_plan.items() if k != "wte"}
    policy.check_tp(policy.model.config, 2)
    assert policy.plan(2).tp_attributes == {"h.*.attn": ("embed_dim", "split_size", "num_heads")}

    class Stages:  # the split is derived only when a pipeline is asked for
        num_stages = 2
    policy.set_pipeline_stage_manager(Stages())
    assert (policy.layers, policy.entry, policy.exit) == ("h", GPT2Policy.entry, GPT2Policy.exit)

    policy = as_policy([OPTLayerPolicy()])
    policy.set_model(mu.build("opt_lm"))
    policy.set_pipeline_stage_manager(Stages())
    assert policy.layers == "decoder.layers"
    assert policy.entry == {"decoder.embed_tokens": "input", "decoder.embed_positions": "zeros"}
    assert policy.exit == ("decoder.final_layer_norm",)
    assert policy.tp_plan["decoder.layers.*.self_attn.q_proj"] == Colwise()
    assert policy.tp_plan["decoder.layers.*.fc2"] == Rowwise()


def _policy(cls_name, **methods):
    return type(cls_name, (Policy,), {k: staticmethod(v) for k, v in methods.items()})


@pytest.mark.parametrize("policy, message", [
    (_policy("P", original_layer_class=lambda: OPTDecoderLayer), "no list of OPTDecoderLayer"),
    (_policy("P", original_layer_class=lambda: GPT2Block,
             attn_qkv=lambda: [Layer(weight="attn.c_attn.weight", n_fused=3),
                               Layer(weight="crossattention.q_attn.weight", ignore_checker=True)]), None),
    (_policy("P", original_layer_class=lambda: GPT2Block,
             attn_qkv=lambda: [Layer(weight="attn.c_attn.weight", n_fused=3, reversed=False)]), "set reversed=True"),
    (_policy("P", original_layer_class=lambda: GPT2Block,
             mlp_in=lambda: [Layer(weight="mlp.c_gate.weight")]), "ignore_checker=True"),
    (_policy("P", original_layer_class=lambda: GPT2Block,
             mlp_out=lambda: [Layer(weight="mlp.c_proj.weight", replace=object)]), "pass replace=None"),
])
def test_wrong_policies_are_refused(policy, message):
    translated = as_policy(policy)
    if message is None:  # reversed=None: taken from the module; ignore_checker: absent modules skipped
        translated.set_model(mu.build("gpt2_lm"))
        assert translated.tp_plan == {"h.*.attn.c_attn": Colwise(n_fused=3)}
        return
    with pytest.raises(ValueError, match=message):
        translated.set_model(mu.build("gpt2_lm"))


def test_replace_modules_gives_modules_the_new_class():
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    class MyMLP(GPT2MLP):
        pass
    policy = as_policy(_policy("P", original_layer_class=lambda: GPT2Block, replace_modules=lambda: {"GPT2MLP": MyMLP}))
    policy.set_model(mu.build("gpt2_lm"))
    assert all(type(block.mlp) is MyMLP for block in policy.model.transformer.h)


def test_inexact_replace_arguments_and_foreign_policies_are_refused():
    bad = _policy("P", original_layer_class=lambda: GPT2Block,
                  replace_arguments=lambda config, ws: {"attn.num_heads": config.n_head // ws + 1})
    policy = as_policy(bad)
    policy.set_model(mu.build("gpt2_lm"))
    with pytest.raises(ValueError, match="only exact division"):
        policy.check_tp(policy.model.config, 2)
    with pytest.raises(TypeError, match="Parallelformers-style"):
        as_policy(object())
    assert isinstance(as_policy([GPT2BlockPolicy, OPTLayerPolicy]), TranslatedPolicy)


def test_encoder_and_decoder_policies_cover_both_stacks_and_refuse_pp():
    policy = as_policy([BartEncoderLayerPolicy, BartDecoderLayerPolicy])
    policy.set_model(mu.build("bart_lm", 2))
    assert policy.tp_plan["encoder.layers.*.self_attn.q_proj"] == Colwise()
    assert policy.tp_plan["decoder.layers.*.encoder_attn.out_proj"] == Rowwise()
    assert "encoder.layers.*.encoder_attn.q_proj" not in policy.tp_plan
    with pytest.raises(NotImplementedError, match="Use pp_size=1"):
        policy.set_pipeline_stage_manager(type("Stages", (), {"num_stages": 2})())


def four_ranks():
    for kind, policy in (("gpt2_lm", GPT2BlockPolicy), ("opt_lm", [OPTLayerPolicy])):
        mu.check_training(kind, tp_size=2, custom_policy=policy)  # dp=2
        mu.check_training(kind, pp_size=4, num_microbatches=4, custom_policy=policy)
        mu.check_training(kind, tp_size=2, pp_size=2, num_microbatches=2, custom_policy=policy)
    mu.check_training("bart_lm", layers=2, tp_size=2, custom_policy=[BartEncoderLayerPolicy, BartDecoderLayerPolicy])
