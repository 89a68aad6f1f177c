"""ColossalAI training-loop semantics a ported script relies on, each against one process (2 ranks, one launch):
an optimizer that stepped before boost (its state carried onto the shards by name), a model whose modules a script
replaced with its own classes (no tp plan asked without tensor parallelism), and Booster(mixed_precision=...) with
TorchDDPPlugin (torch AMP, as ColossalAI's FP16TorchMixedPrecision)."""
import copy
import os

import pytest
import torch
import torch.distributed as dist

from booster_plugin import Booster, HybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from shardformer.policies.from_transformers import PlanRefused
from tests import model_utils as mu
from tests.dist_utils import run_distributed

HALF = 2


def _amp(precision: str, directory: str) -> None:
    """TorchDDPPlugin under Booster(mixed_precision=...) equals one process running the same autocast (and, fp16,
    GradScaler) on the global batch; accumulation under no_sync, clipping and save_model work through the wrapper."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    reference = mu.build("llama_lm")
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    booster = Booster(mixed_precision=precision, plugin=TorchDDPPlugin())
    model = copy.deepcopy(reference)
    model, opt, criterion, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6),
                                              mu.criterion)
    for step in range(2):
        batch = mu.make_batch("llama_lm", 2 * HALF * world, seed=10 + step)
        parts = [{k: v[i * HALF:(i + 1) * HALF] for k, v in batch.items()} for i in range(2 * world)]
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            ref_losses = [mu.criterion(reference(**p), p) for p in parts]
        scaler.scale(torch.stack(ref_losses).mean()).backward()
        scaler.unscale_(ref_opt)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        scaler.step(ref_opt)
        scaler.update()
        with booster.no_sync(model, opt):
            out = model(**parts[2 * rank])
            assert out.logits.dtype == dtype, f"{precision}: the forward did not run under autocast"
            booster.backward(criterion(out, parts[2 * rank]) / 2, opt)
        booster.backward(criterion(model(**parts[2 * rank + 1]), None) / 2, opt)
        norm = opt.clip_grad_by_norm(1.0)
        mu.assert_close(norm, ref_norm, f"{precision} step {step} grad norm", 1e-4 if precision == "fp16" else 1e-3)
        opt.step()
        opt.zero_grad()
        for (name, p), q in zip(model.unwrap().named_parameters(), reference.parameters()):
            # the same low-precision forward and backward per half batch, their loss scaled by other powers of two
            # (1/2 per rank here, 1/4 there: the same except for fp16 subnormals) and summed in another order:
            # Adam's first step lr * g / |g| moves an element whose g is ~0 by up to lr (1e-3) either way: half a
            # step for fp16, a whole sign flip for bf16's 8-bit mantissa (the gradient norm is checked at 1e-4)
            mu.assert_close(p.data, q.data, f"{precision} step {step} {name}", 5e-4 if precision == "fp16" else 2e-3)
        assert opt.scaler.get_scale() == scaler.get_scale(), (opt.scaler.get_scale(), scaler.get_scale())
    path = os.path.join(directory, f"amp_{precision}")
    booster.save_model(model, path)
    loaded = type(reference).from_pretrained(path)
    for (name, p), q in zip(loaded.named_parameters(), model.unwrap().parameters()):
        mu.assert_close(p.data, q.data, f"{precision} saved {name}", 0)


class _Net(torch.nn.Module):
    """Not a transformers model: LowLevelZeroPlugin takes any nn.Module, as ColossalAI's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _any_module(directory: str) -> None:
    """LowLevelZeroPlugin (ZeRO-2) trains a plain nn.Module equal to one process on the global batch; its weights
    save and load."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _Net()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
    model = copy.deepcopy(reference)
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2))
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6))
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        mine = slice(4 * rank, 4 * (rank + 1))
        booster.backward(torch.nn.functional.mse_loss(model(x[mine]), y[mine]), opt)
        opt.step()
        opt.zero_grad()
    for (name, p), q in zip(model.unwrap().named_parameters(), reference.parameters()):
        mu.assert_close(p.data, q.data, f"plain module {name}")
    path = os.path.join(directory, "plain.safetensors")
    booster.save_model(model, path)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    booster.load_model(model, path)
    for (name, p), q in zip(model.unwrap().named_parameters(), reference.parameters()):
        mu.assert_close(p.data, q.data, f"plain module {name} reloaded")


def _cases(directory: str) -> None:
    # an optimizer that stepped before boost: its Adam moments and step count continue on the shards
    mu.check_training("llama_lm", tp_size=2, pre_steps=2)
    mu.check_training("llama_lm", zero_stage=2, pre_steps=2)  # ZeRO partitions the carried state over dp
    mu.check_training("llama_lm", zero_stage=1, precision="bf16", pre_steps=1, tol=2e-2)  # onto fp32 masters
    # a script's own module in place of one the tp plan shards: no tp plan needed without tensor parallelism
    mu.check_training("llama_own_lora_lm", zero_stage=2)
    mu.check_training("llama_own_lora_lm", pp_size=2, num_microbatches=2)
    with pytest.raises(PlanRefused, match="cannot be tensor-parallel: tp plan shards 'model.embed_tokens' "
                                          r"\(OwnLoraEmbedding\) as VocabEmbedding.*Use tp_size=1"):
        Booster(plugin=HybridParallelPlugin(tp_size=2)).boost(mu.build("llama_own_lora_lm"))
    _amp("fp16", directory)
    _amp("bf16", directory)
    _any_module(directory)


def test_colossalai_training_semantics(tmp_path):
    run_distributed(2, _cases, str(tmp_path))


def test_booster_mixed_precision_names():
    with pytest.raises(NotImplementedError, match="fp16_apex.*Use 'fp16'"):
        Booster(mixed_precision="fp16_apex")
    with pytest.raises(ValueError, match="expected one of 'fp16', 'bf16'"):
        Booster(mixed_precision="fp64")
