"""A policy's plan and its pipeline placement are frozen values (issue 35): the plan is read-only and fitted to the
tp size without rewriting the policy; the placement is decided once on the unsharded model and stays true after the
model is cut down to one stage's layers."""
import dataclasses

import pytest
from transformers import LlamaForCausalLM

from pipeline.layout import StageLayout
from shardformer.policies import get_autopolicy
from shardformer.tensor.styles import KVHeads
from tests import model_utils as mu


class _FirstOfTwoStages:
    """Stage 0 of a 2-rank pipeline holding 1 + 3 layers (a stage manager without processes)."""
    num_stages, num_model_chunks, stage = 2, 1, 0
    layout = StageLayout(2)

    def layers_per_virtual_stage(self, num_layers, costs=None):
        return [1, num_layers - 1]


def test_plan_is_frozen_and_fitted_to_tp_without_rewriting_the_policy():
    model = LlamaForCausalLM(mu.llama_config(2, num_key_value_heads=1))
    policy = get_autopolicy(model)  # transformers' plans: more tp ranks than key/value heads replicate them
    before, divisible = dict(policy.tp_plan), tuple(policy.tp_divisible)
    policy.check_tp(model.config, 2)
    plan = policy.plan(2)
    assert any(isinstance(style, KVHeads) for style in plan.tp_plan.values())
    assert "num_key_value_heads" not in plan.tp_divisible
    assert dict(policy.tp_plan) == before and tuple(policy.tp_divisible) == divisible  # the policy is untouched
    assert not any(isinstance(style, KVHeads) for style in policy.plan(1).tp_plan.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layers = "h"
    with pytest.raises(TypeError):
        plan.tp_plan["lm_head"] = None


def test_placement_is_decided_once_on_the_unsharded_model():
    model = mu.build("gpt2_lm", layers=4)
    policy = get_autopolicy(model)
    policy.set_model(model)
    policy.set_pipeline_stage_manager(_FirstOfTwoStages())
    placement = policy.stage_placement()
    assert placement.split == (1, 3) and placement.num_layers == 4
    assert placement.stage_of_param("transformer.h.2.attn.c_attn.weight") == (1,)
    assert placement.stage_of_param("transformer.wte.weight") == (0,)
    assert placement.shared_names() == [{0: "transformer.wte.weight", 1: "lm_head.weight"}]
    del model.transformer.h[1:]  # as after sharding: this stage's layers only
    assert policy.stage_placement() is placement and policy.layers_per_stage() == [1, 3]
    assert policy.stage_of_param("transformer.h.3.mlp.c_fc.weight") == (1,)
    with pytest.raises(KeyError, match="not a parameter of the unsharded model"):
        placement.stage_of_param("transformer.h.9.mlp.c_fc.weight")
