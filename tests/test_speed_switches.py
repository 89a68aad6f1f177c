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
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compiled layers fuse the norms: Liger is not asked for, nothing to say
        assert _speed(enable_all_optimization=True) == SpeedConfig(True, None, "sdpa")
        assert _speed(enable_fused_normalization=True, enable_jit_fused=True) == SpeedConfig(True, None, None)
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


def _gemini_compiled() -> None:
    """GeminiPlugin(enable_jit_fused=True): its decoder layers run compiled (after fully_shard) and an AdamW step
    equals one eager process."""
    from booster_plugin import Booster, GeminiPlugin
    reference = mu.build("llama_lm", 2)
    model = mu.build("llama_lm", 2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    plugin = GeminiPlugin(enable_jit_fused=True)
    assert plugin.speed == SpeedConfig(True, None, None)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6))
    torch._dynamo.utils.counters.clear()
    batch = mu.make_batch("llama_lm", 2, 0)
    loss = model(**batch).loss
    booster.backward(loss, opt)
    opt.step()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "no layer ran compiled"
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    ref_opt.step()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.unwrap().state_dict().items()}
    for name, p in reference.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), atol=1e-5, rtol=1e-5, msg=name)


def test_attention_set_at_boost_and_gemini_compiled():
    run_distributed(1, _one_rank)
    run_distributed(1, _gemini_compiled)
