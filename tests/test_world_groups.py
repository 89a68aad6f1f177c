"""Any world group a script creates works, also one without a CPU backend, as `init_process_group("nccl")` makes on
GPUs: on CPU, `"cuda:gloo"` gives that shape (CPU tensors on it raise "No backend type associated with device type
cpu"), so every layout below runs exactly as under NCCL's world group, where the library's own groups
(`pipeline.groups`) must carry its host-side values. Each run equals one process (loss, gradients, parameters after
AdamW, 1e-5) and save and load round-trip. (Also in this world shape: a collective called on one rank and a failure on
one stage, test_reliability.py; the examples, test_examples.py.)"""
from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

from pipeline.groups import backend_map, barrier_group, group_backend, world_group
from tests import model_utils as mu
from tests import test_expert_parallel  # noqa: F401  (registers the MoE families in mu.MODELS)
from tests.dist_utils import run_distributed
from tests.test_pipeline_generate import check_direct_calls
from tests.test_fsdp_plugins import PLUGINS, _train_save_resume

NCCL_SHAPED = "cuda:gloo"  # a world group with no CPU backend, as "nccl"
SP = dict(enable_sequence_parallelism=True)


def _check_world_has_no_cpu_backend() -> None:
    assert "cpu" not in backend_map(), dist.get_backend_config()
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(1))  # what the library must never do on such a group
    assert group_backend() == "cpu:gloo,cuda:gloo"
    assert "cpu" in backend_map(world_group()) and str(dist.get_backend(barrier_group())) == "gloo"


def _four_ranks(directory: str) -> None:
    _check_world_has_no_cpu_backend()
    mu.check_training("llama_lm", tp_size=2, pp_size=2, num_microbatches=2, save_to=directory)
    mu.check_training("llama_lm", steps=3, tp_size=2, pp_size=2, num_microbatches=2, resume_from=(directory, 2))
    mu.check_training("gpt2_lm", tp_size=2, zero_stage=2, max_norm=0.1)  # dp 2
    mu.check_training("qwen3moe_lm", ep_size=2, pp_size=2, num_microbatches=2)  # router loss on; dp 2 = ep 2
    mu.check_training("llama_packed_lm", sp_size=2, sequence_parallelism_mode="ring_attn", zero_stage=1, **SP)
    mu.check_evaluation("llama_lm", tp_size=2, pp_size=2, num_microbatches=2)
    check_direct_calls("llama_lm", tp_size=2, pp_size=2)  # model(**batch) and generate, pipelined


def _two_ranks(directory: str) -> None:
    _check_world_has_no_cpu_backend()
    for kind in PLUGINS:  # GeminiPlugin (clipping) and TorchFSDPPlugin: train, save, load, resume
        _train_save_resume(kind, directory)


def test_nccl_shaped_world_four_ranks():
    with tempfile.TemporaryDirectory() as directory:
        run_distributed(4, _four_ranks, directory, backend=NCCL_SHAPED)


def test_nccl_shaped_world_fsdp_plugins():
    with tempfile.TemporaryDirectory() as directory:
        run_distributed(2, _two_ranks, directory, backend=NCCL_SHAPED)
