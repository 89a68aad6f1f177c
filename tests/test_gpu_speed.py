"""The speed switches where they act on a GPU (`make gpu-check`, HP_TEST_DEVICE=cuda): Liger's fused norms, alone and
with the compiled decoder layers and microbatches, train equal to one process in a world of one (fp32: loss, grads,
parameters after AdamW, 1e-5). Liger's kernels are Triton kernels for CUDA: on a CPU the plugin refuses them
(tests/test_speed_switches.py), so this test runs only where they can (the reason is the skip's)."""
import pytest
import torch

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.core.fused_kernels import liger_unusable
from tests import model_utils as mu
from tests.dist_utils import TEST_DEVICE, run_distributed

pytestmark = pytest.mark.cuda


def _liger() -> None:
    boosted, *_ = Booster(plugin=HybridParallelPlugin(fused_kernels="liger")).boost(mu.build("llama_lm", 2).to(mu.DEVICE))
    swapped = {type(m).__name__ for m in boosted.unwrap().modules() if type(m).__name__.startswith("Liger")}
    assert swapped == {"LigerRMSNorm"}, swapped
    mu.check_training("llama_lm", fused_kernels="liger")
    mu.check_training("llama_lm", num_microbatches=2, fused_kernels="liger", compile_layers=True)


def test_liger_norms_train_equal_one_process():
    reason = liger_unusable(torch.device(TEST_DEVICE))
    if reason is not None:
        pytest.skip(reason)
    run_distributed(1, _liger)
