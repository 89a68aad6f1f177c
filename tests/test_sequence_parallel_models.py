"""Sequence parallelism on mixture-of-experts models and on Gemma 2's soft-capped attention, exact against one
process (tests/model_utils.check_training: loss, every gradient, parameters after 2 AdamW steps, fp32, 1e-5).

- MoE (Mixtral, Qwen3-MoE; the router's load-balancing loss on: output_router_logits=True, router_aux_loss_coef=1)
  under Ulysses ("all_to_all") and ring attention ("ring_attn") over sp_size=2, also with ep=2 (4 ranks), pp=2 and
  tp=2: each rank's routers see its tokens, and their logits are gathered over sp before the model's own loss
  (shardformer/expert/router_logits.py), so the aux loss (a product of per-expert means over all tokens, padding excluded)
  is one process's; rows with padding (attention mask) and packed rows (no mask: every token counts).
- Gemma 2 (sliding and full layers, attn_logit_softcapping=1 so that the cap shapes most scores) under ring
  attention, whose blocks soft-cap the scores (and Ulysses, which runs the model's own eager function).
"""
from __future__ import annotations

import pytest
import transformers

from booster_plugin import Booster, HybridParallelPlugin
from hp_check.tiny import tiny_config
from tests import model_utils as mu
from tests.dist_utils import run_distributed
from tests import test_expert_parallel  # noqa: F401 (registers qwen3moe_lm, mixtral_lm, gptoss_lm, ...)

SP = dict(enable_sequence_parallelism=True)
MODES = ("all_to_all", "ring_attn")

mu.MODELS.update({
    "qwen3moe_packed_lm": mu.MODELS["qwen3moe_lm"],  # packed rows: no attention mask, documents by position ids
    "qwen3moe_noaux_lm": lambda n=4: transformers.Qwen3MoeForCausalLM(tiny_config(  # no router loss: nothing gathered
        transformers.Qwen3MoeConfig, num_hidden_layers=n, num_experts=4, num_experts_per_tok=2)),
    "gemma2_softcap_lm": lambda n=4: transformers.Gemma2ForCausalLM(tiny_config(
        transformers.Gemma2Config, num_hidden_layers=n, attn_logit_softcapping=1.0)),  # eager, window 4 < 8 tokens
})


def _errors() -> None:
    """Refused alike on every rank, before any collective, naming the fix."""
    with pytest.raises(NotImplementedError, match=r"'split_gather' on Qwen3MoeForCausalLM, a mixture-of-experts "
                                                  r"model .* Use sequence_parallelism_mode='all_to_all' or 'ring_attn'"):
        Booster(plugin=HybridParallelPlugin(tp_size=2, **SP)).boost(mu.build("qwen3moe_lm"))
    plugin = HybridParallelPlugin(sp_size=2, sequence_parallelism_mode="all_to_all", **SP)
    with pytest.raises(NotImplementedError, match=r"attention 'layers.\*.self_attn' reads a per-head parameter "
                                                  r"'sinks' whole.* use sequence_parallelism_mode='ring_attn'"):
        Booster(plugin=plugin).boost(mu.build("gptoss_lm"))


def _two_ranks() -> None:
    _errors()
    for kind in ("mixtral_lm", "qwen3moe_lm"):
        for mode in MODES:
            mu.check_training(kind, sp_size=2, sequence_parallelism_mode=mode, **SP)
    mu.check_training("qwen3moe_packed_lm", sp_size=2, sequence_parallelism_mode="ring_attn", **SP)
    mu.check_training("qwen3moe_noaux_lm", steps=1, sp_size=2, sequence_parallelism_mode="all_to_all", **SP)
    mu.check_training("qwen3moe_lm", steps=1, tp_size=2, sequence_parallelism_mode="all_to_all", **SP)  # over tp
    for mode in MODES:
        mu.check_training("gemma2_softcap_lm", sp_size=2, sequence_parallelism_mode=mode, **SP)


def test_moe_and_softcap_under_sequence_parallelism():
    run_distributed(2, _two_ranks)


def _four_ranks() -> None:
    for kind in ("mixtral_lm", "qwen3moe_lm"):  # sp 2 x ep 2 (dp 2 = ep 2): experts dispatched from the shards
        for mode in MODES:
            mu.check_training(kind, sp_size=2, ep_size=2, sequence_parallelism_mode=mode, **SP)
    # the router logits of the first stage travel to the last as shards, gathered there with the last stage's
    mu.check_training("qwen3moe_lm", steps=1, sp_size=2, pp_size=2, num_microbatches=2,
                      sequence_parallelism_mode="ring_attn", **SP)
    mu.check_training("mixtral_lm", steps=1, sp_size=2, tp_size=2, sequence_parallelism_mode="ring_attn", **SP)


def test_moe_sequence_parallel_with_ep_pp_tp():
    run_distributed(4, _four_ranks)
