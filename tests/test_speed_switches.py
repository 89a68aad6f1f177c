"""Speed switches act (plugins/speed.py): ColossalAI's enable_jit_fused / enable_fused_normalization /
enable_flash_attention / enable_all_optimization map onto compile_layers, fused_kernels (Liger, CUDA only: refused
or replaced by the compiled layers here, saying why) and attn_implementation; an attention implementation set at
boost trains equal to one process."""
import warnings

import pytest
import torch

from booster_plugin import HybridParallelPlugin
from booster_plugin.core.attention_choice import resolve_attention, use_attention
from booster_plugin.core.fused_kernels import liger_unusable
from booster_plugin.plugins.speed import SpeedConfig
from tests import model_utils as mu
from tests.dist_utils import run_distributed

CPU = torch.device("cpu")
OFF = dict(enable_all_optimization=False, enable_fused_normalization=False, enable_flash_attention=False,
           enable_jit_fused=False)


def _speed(compile_layers=False, fused_kernels=None, attn_implementation=None, **switches) -> SpeedConfig:
    return SpeedConfig.build(compile_layers, fused_kernels, attn_implementation, {**OFF, **switches}, CPU, 0)


def test_switch_mapping_on_cpu():
    assert _speed() == SpeedConfig(False, None, None)  # defaults: the model as it is
    assert _speed(enable_jit_fused=True) == SpeedConfig(True, None, None)
    assert _speed(enable_flash_attention=True) == SpeedConfig(False, None, "sdpa")
    assert _speed(attn_implementation="eager", enable_flash_attention=True).attn_implementation == "eager"
    with pytest.warns(UserWarning, match="Liger-Kernel's kernels are Triton kernels for CUDA GPUs; this run is on "
                                         "cpu; the compiled decoder layers"):
        assert _speed(enable_fused_normalization=True) == SpeedConfig(True, None, None)
    with pytest.warns(UserWarning, match="fuse the norms instead"):
        assert _speed(enable_all_optimization=True) == SpeedConfig(True, None, "sdpa")
    with pytest.raises(ValueError, match="fused_kernels='liger': Liger-Kernel's kernels are Triton kernels for CUDA "
                                         "GPUs; this run is on cpu. Drop it; compile_layers=True"):
        _speed(fused_kernels="liger")
    with pytest.raises(ValueError, match="fused_kernels='apex': use one of"):
        _speed(fused_kernels="apex")
    assert liger_unusable(CPU) is not None
    assert resolve_attention("auto", CPU) == "sdpa" and resolve_attention(None, CPU) is None
    with pytest.raises(TypeError, match="needs a transformers model"):
        use_attention(torch.nn.Linear(2, 2), "sdpa")


def _one_rank() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the Liger fallback's note, checked above)
        plugin = HybridParallelPlugin(enable_all_optimization=True)
    assert plugin.config.sharding.speed == SpeedConfig(True, None, "sdpa")
    assert plugin.config.sharding.chunked_loss
    reference = mu.build("llama_lm", 1)
    reference.set_attn_implementation("eager")
    model = mu.build("llama_lm", 1)
    model.set_attn_implementation("eager")
    plugin = HybridParallelPlugin(attn_implementation="sdpa")
    from booster_plugin import Booster
    boosted, *_ = Booster(plugin=plugin).boost(model)
    assert boosted.unwrap().config._attn_implementation == "sdpa"
    batch = mu.make_batch("llama_lm", 2, 0)
    torch.testing.assert_close(boosted(**batch).loss, reference(**batch).loss, atol=1e-5, rtol=1e-5)


def test_attention_set_at_boost():
    run_distributed(1, _one_rank)
