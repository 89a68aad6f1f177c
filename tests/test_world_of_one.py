"""A world of one process: the plugin's own machinery (microbatches, precision, clipping, ZeRO's no-op, checkpoints,
lazy loading, LoRA, MoE with its router loss, evaluation, the FSDP plugins, HF Trainer on the GPU) equals one plain
process. On CPU in CI; on the GPU with NCCL under HP_TEST_DEVICE=cuda (`make gpu-check`), where the references run
on the GPU too.

Reference: the unsharded model in the same process (tests/model_utils.check_training): loss, every gradient and the
parameters after AdamW steps, 1e-5 in fp32."""
from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

from booster_plugin import Booster, HybridParallelPlugin

from tests import model_utils as mu
from tests import test_expert_parallel  # noqa: F401  (registers the MoE families in mu.MODELS)
from tests.dist_utils import run_distributed
from tests.test_fsdp_plugins import PLUGINS, _train_save_resume
from tests.test_lazy_pretrained import _check_layout, saved  # noqa: F401  (saved: the fixture of saved checkpoints)
from tests.test_lora import _train_like_peft

pytestmark = pytest.mark.cuda

MIXED_TOL = 3e-2  # bf16 / fp16 compute against the fp32 reference


def _rotary_tables_stay_fp32() -> None:
    """precision="bf16" casts the model as from_pretrained(dtype=bf16) builds it: the rotary frequency table in fp32
    (rounded to bf16, positions far from 0 would get other angles), the weights in bf16."""
    reference = mu.build("llama_lm").to(mu.DEVICE)
    booster = Booster(plugin=HybridParallelPlugin(precision="bf16"))
    model, *_ = booster.boost(copy.deepcopy(reference))
    rotary = model.unwrap().model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, reference.model.rotary_emb.inv_freq)
    assert model.unwrap().model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def _plugin_cases(directory: str) -> None:
    _rotary_tables_stay_fp32()
    mu.check_training("llama_lm")  # model(**batch) + booster.backward
    mu.check_training("llama_lm", num_microbatches=2, save_to=directory)  # execute_pipeline: accumulation
    mu.check_training("llama_lm", steps=3, num_microbatches=2, resume_from=(directory, 2))
    mu.check_training("gpt2_lm", max_norm=0.1, zero_stage=1)  # dp size 1: runs as zero_stage=0, clipped
    mu.check_training("llama_lm", num_microbatches=2, precision="bf16", tol=MIXED_TOL)
    mu.check_training("gpt2_lm", precision="fp16", tol=MIXED_TOL)
    mu.check_training("qwen3moe_lm", num_microbatches=2)  # router loss on (coefficient 1.0)
    mu.check_training("gptoss_lm")
    mu.check_evaluation("llama_lm", num_microbatches=2)


def _trainer(directory: str) -> None:
    """HF Trainer with the plugin (accumulation, warm-up, decay, clipping, evaluate() with compute_metrics, checkpoints,
    save_model and from_pretrained) equals a plain Trainer in this process, on the test device."""
    from tests import test_trainer as tt
    on_cpu = mu.DEVICE.type == "cpu"
    reference = tt._reference(os.path.join(directory, "trainer_ref"), 1, use_cpu=on_cpu)
    ours = os.path.join(directory, "trainer_ours")
    tt._check_layout(dict(zero_stage=1), reference, ours, use_cpu=on_cpu, save_strategy="steps", save_steps=3)
    assert sorted(os.listdir(ours)) == ["checkpoint-3", "checkpoint-6", "final"], os.listdir(ours)


def _integrations(directory: str, paths) -> None:
    if mu.DEVICE.type == "cuda":  # (on CPU tests/test_trainer.py runs the Trainer in every layout)
        _trainer(directory)
    _train_like_peft("llama_lm")
    _check_layout(paths["tied"], 1, 1, tied=True)  # LazyInitContext + from_pretrained, then boost
    for kind in PLUGINS:  # GeminiPlugin (clipping), TorchFSDPPlugin
        _train_save_resume(kind, directory)


def test_world_of_one_plugin():
    with tempfile.TemporaryDirectory() as directory:
        run_distributed(1, _plugin_cases, directory)


def test_world_of_one_integrations(saved):  # noqa: F811
    with tempfile.TemporaryDirectory() as directory:
        run_distributed(1, _integrations, directory, saved)
