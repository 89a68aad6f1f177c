"""Expert parallelism (ep_size): MoE families trained under ep layouts equal one process — loss with the router's
load-balancing loss on, every gradient, parameters after AdamW — and expert gradients never hang when experts get no
tokens."""
from __future__ import annotations

import pytest
import transformers

from booster_plugin import GradientCheckpointConfig
from hp_check.tiny import tiny_config
from tests import model_utils as mu
from tests.dist_utils import run_distributed


def _moe(config_class, model_class, **extra):
    def build(n=4):
        config = tiny_config(config_class, num_hidden_layers=n, output_router_logits=True, router_aux_loss_coef=1.0,
                             **extra)
        return model_class(config)
    return build


mu.MODELS.update({
    "qwen3moe_lm": _moe(transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, num_experts=4,
                         num_experts_per_tok=2),
    "mixtral_lm": _moe(transformers.MixtralConfig, transformers.MixtralForCausalLM, num_local_experts=4,
                       num_experts_per_tok=2),
    "olmoe_lm": _moe(transformers.OlmoeConfig, transformers.OlmoeForCausalLM, num_experts=4, num_experts_per_tok=2),
    "gptoss_lm": _moe(transformers.GptOssConfig, transformers.GptOssForCausalLM, num_local_experts=4,
                      num_experts_per_tok=2),
    "deepseekv3_lm": _moe(transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, n_routed_experts=4,
                          num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1),
})


def _gptoss_idle_experts(n=4):
    """GPT-OSS whose router never picks experts 2 and 3 (a -1e4 bias): under ep=2 the second ep rank's experts get no
    tokens in any step. The family's own (eager) experts forward, which leaves unrouted experts out of the graph
    (the default grouped_mm implementation touches every expert)."""
    model = mu.MODELS["gptoss_lm"](n)
    model.config._experts_implementation = "eager"
    for layer in model.model.layers:
        layer.mlp.router.bias.data[2:] = -1e4
    return model


mu.MODELS["gptoss_idle_lm"] = _gptoss_idle_experts
FAMILIES = ("qwen3moe_lm", "mixtral_lm", "olmoe_lm", "gptoss_lm", "deepseekv3_lm")


def _two_ranks():
    for kind in FAMILIES:
        mu.check_training(kind, steps=2, ep_size=2)  # dp 2 = ep 2


def test_expert_parallel_two_ranks():
    run_distributed(2, _two_ranks)


def _four_ranks():
    mu.check_training("qwen3moe_lm", steps=2, ep_size=2, tp_size=2)  # dp 2 = ep 2, experts split over tp inside
    mu.check_training("qwen3moe_lm", steps=2, ep_size=2, pp_size=2, num_microbatches=2)  # dp 2 = ep 2
    for zero in (1, 2):  # dp 4 = moe_dp 2 x ep 2: expert gradients partitioned over moe_dp
        mu.check_training("qwen3moe_lm", steps=2, ep_size=2, zero_stage=zero, precision="fp32")
    mu.check_training("mixtral_lm", steps=1, ep_size=4, max_norm=0.05)  # every expert on its own rank, clipped
    mu.check_training("gptoss_lm", steps=1, ep_size=2, dp_outside=False, pp_size=2, num_microbatches=2)
    for kind in ("mixtral_lm", "gptoss_lm"):  # the router loss at ep=2 x {pp=2, tp=2, ZeRO-2} (Qwen3-MoE: above)
        mu.check_training(kind, steps=1, ep_size=2, pp_size=2, num_microbatches=2)  # dp 2 = ep 2
        mu.check_training(kind, steps=1, ep_size=2, tp_size=2)  # dp 2 = ep 2
        mu.check_training(kind, steps=1, ep_size=2, zero_stage=2)  # dp 4 = moe_dp 2 x ep 2
    for zero in (0, 2):  # dp 4 = moe_dp 2 x ep 2, experts of ep rank 1 never routed: nothing hangs, zero gradients
        mu.check_training("gptoss_idle_lm", steps=2, ep_size=2, zero_stage=zero, max_norm=0.05)
    mu.check_training("gptoss_idle_lm", steps=1, ep_size=2, precision="fp16", tol=5e-3)  # overflow checks too
    # activation checkpointing, bf16, the V schedule (split backward), LoRA on attention
    mu.check_training("qwen3moe_lm", steps=1, ep_size=2, tp_size=2, precision="bf16", tol=3e-2,
                      gradient_checkpoint_config=GradientCheckpointConfig(gradient_checkpointing_ratio=1.0))
    mu.check_training("qwen3moe_lm", steps=1, ep_size=2, pp_size=2, pp_style="zbv", num_model_chunks=2,
                      num_microbatches=4)
    from tests.test_lora import _train_like_peft
    _train_like_peft("qwen3moe_lm", steps=1, ep_size=2, tp_size=2)
    from tests.test_lazy_pretrained import check_from_config
    check_from_config(2, 2)  # lazy init from a config: eager init's weights at tp=2 x pp=2, and with experts over ep
    check_from_config(2, 1, ep_size=2)


def test_expert_parallel_four_ranks():
    run_distributed(4, _four_ranks)


def _reference_after(kind: str, steps: int, dp: int, local_batch: int = 8, mb: int = 4):
    """The unsharded model trained as check_training trains its reference (AdamW, the same global batches)."""
    import torch
    reference = mu.build(kind)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    for step in range(steps):
        batch = mu.make_batch(kind, local_batch * dp, seed=100 + step)
        opt.zero_grad()
        torch.stack([mu.microbatch_mean_loss(reference, {k: v[r * local_batch:(r + 1) * local_batch]
                                                         for k, v in batch.items()}, mb) for r in range(dp)]).mean().backward()
        opt.step()
    return reference


def _checkpoints(directory: str):
    import os

    import torch
    import torch.distributed as dist
    # saved from ep=2 x pp=2: from_pretrained gives the trained model
    mu.check_training("qwen3moe_lm", steps=2, ep_size=2, pp_size=2, num_microbatches=2, save_to=directory)
    if dist.get_rank() == 0:
        loaded = transformers.Qwen3MoeForCausalLM.from_pretrained(os.path.join(directory, "model")).eval()
        reference = _reference_after("qwen3moe_lm", steps=2, dp=2).eval()
        batch = mu.make_batch("qwen3moe_lm", 4, seed=7)
        with torch.no_grad():
            mu.assert_close(loaded(**batch).logits, reference(**batch).logits, "from_pretrained logits")
    dist.barrier()
    # resumed into ep=1 x tp=2 and into ep=2 x tp=2 with ZeRO-2 (the same dp and microbatches: the router loss is
    # per microbatch): equal to uninterrupted training
    mu.check_training("qwen3moe_lm", steps=3, tp_size=2, num_microbatches=2, resume_from=(directory, 2))
    mu.check_training("qwen3moe_lm", steps=3, ep_size=2, tp_size=2, zero_stage=2, num_microbatches=2,
                      resume_from=(directory, 2))


def test_expert_parallel_checkpoints(tmp_path):
    run_distributed(4, _checkpoints, str(tmp_path))


def _errors():
    import torch.distributed as dist

    from booster_plugin import Booster, HybridParallelPlugin, MoeHybridParallelPlugin
    with pytest.raises(ValueError, match="ep_size=3 must divide the data-parallel size 2"):
        HybridParallelPlugin(ep_size=3)
    with pytest.raises(ValueError, match="ep_size=2 must divide the data-parallel size 1"):
        MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=2)
    with pytest.raises(ValueError, match="has no experts module"):
        Booster(plugin=HybridParallelPlugin(ep_size=2)).boost(mu.build("llama_lm"))
    odd = transformers.Qwen3MoeForCausalLM(tiny_config(transformers.Qwen3MoeConfig, num_experts=3,
                                                       num_experts_per_tok=2))
    with pytest.raises(ValueError, match=r"must divide the number of experts .* \(3 in"):
        Booster(plugin=HybridParallelPlugin(ep_size=2)).boost(odd)
    with pytest.raises(NotImplementedError, match="split_gather.* a mixture-of-experts model .* not supported"):
        Booster(plugin=HybridParallelPlugin(tp_size=2, enable_sequence_parallelism=True)).boost(mu.build("qwen3moe_lm"))
    assert dist.get_world_size() == 2


def test_expert_parallel_errors():
    run_distributed(2, _errors)
