"""Precision and RNG on 2 ranks: `boost` and training leave the script's global RNG alone (tp > 1: dropout draws from
the plugin's generator, masks still equal over tp; tp = 1: from the global RNG, as one process); fp16 stuck at its
minimum loss scale warns, then raises (`on_nonfinite`); ZeRO refuses an element-wise optimizer's subclass that
overrides its update; every pipeline style trains a rotary model (Llama) in bf16 and fp16."""
import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.core.mixed_precision import MAX_SKIPS_AT_MIN_SCALE
from tests import model_utils as mu
from tests.dist_utils import run_distributed

HALF_TOL = 3e-2  # a bf16/fp16 model's loss against the fp32 one's


def _rng_states(device: torch.device) -> list:
    """The script's global RNG: the CPU generator and, on an accelerator, that device's."""
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(torch.get_device_module(device.type).get_rng_state(device))
    return states


def _same_states(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _gpt2_with_dropout():
    model = mu.build("gpt2", layers=2)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.2
    return model


def _check_tp_leaves_the_script_rng():
    """tp=2, each rank seeded differently by the script: boost and a training step leave its RNG as it was (the
    draws after them are those of a process that did not boost), and the dropout masks still agree over tp."""
    model = _gpt2_with_dropout()
    torch.manual_seed(1000 + dist.get_rank())
    plugin = HybridParallelPlugin(tp_size=2)
    script = _rng_states(plugin.device)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert _same_states(_rng_states(plugin.device), script), "boost changed the script's global RNG"
    expected = torch.rand(4, generator=torch.Generator().manual_seed(1000 + dist.get_rank()))
    assert torch.equal(torch.rand(4), expected), "the draws after boost differ from a process that did not boost"
    model.train()
    batch = mu.make_batch("gpt2", 4, 0)
    script = _rng_states(plugin.device)
    outputs = model(**batch)
    booster.backward(mu.criterion(outputs, batch), opt)
    hidden = outputs.last_hidden_state
    opt.step()
    assert _same_states(_rng_states(plugin.device), script), "a training step advanced the script's global RNG"
    parts = [torch.empty_like(hidden) for _ in range(2)]
    dist.all_gather(parts, hidden.detach().contiguous())
    assert torch.equal(parts[0], parts[1]), "dropout masks of replicated activations differ over tp"
    again = model(**batch).last_hidden_state.detach()
    assert not torch.equal(again, hidden.detach()), "dropout is off, or its generator does not advance"


def _check_dp_draws_like_one_process():
    """tp=1 (dp=2): dropout draws from the global RNG as one process does: same output, same state after."""
    reference = _gpt2_with_dropout().train()
    model, *_ = Booster(plugin=HybridParallelPlugin()).boost(copy.deepcopy(reference))
    model.train()
    batch = mu.make_batch("gpt2", 2, dist.get_rank())
    torch.manual_seed(7)
    expected = reference(**batch).last_hidden_state
    after_reference = torch.get_rng_state()
    torch.manual_seed(7)
    mu.assert_close(model(**batch).last_hidden_state, expected, "dp: hidden states with dropout")
    assert torch.equal(torch.get_rng_state(), after_reference), "dp: the forward drew differently from one process"


def _fp16_overflowing_steps(mode: str, pattern: str):
    """pp=2, fp16 from scale 4 (min 1, no hysteresis): an inf gradient on stage 1 at each step whose letter in
    `pattern` is "x" ("." trains); yields (step, returned value or raised error, rank 0's warnings)."""
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2, precision="fp16", on_nonfinite=mode, initial_scale=4,
                                  min_scale=1, hysteresis=1)
    booster = Booster(plugin=plugin)
    model = mu.build("llama_lm", layers=2)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    victim = next(model.unwrap().parameters())
    for step, letter in enumerate(pattern, start=1):
        handle = victim.register_hook(lambda g: g * float("inf")) if letter == "x" and plugin.stage == 1 else None
        booster.execute_pipeline(iter([mu.make_batch("llama_lm", 2, step)]), model, mu.criterion, opt)
        if handle is not None:
            handle.remove()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                outcome = opt.step()
            except FloatingPointError as error:
                outcome = error
        yield step, outcome, [str(w.message) for w in caught if "fp16" in str(w.message)]
        opt.zero_grad()


def _check_fp16_stuck_at_min_scale():
    """Overflows at scales 4 and 2 are the scaler's (silent skips); at min_scale 1: "skip" warns naming the step and
    the scale and raises at the MAX_SKIPS_AT_MIN_SCALE-th in a row (a good step resets the count), "raise" raises at
    once, "ignore" skips silently. Every rank alike."""
    n = MAX_SKIPS_AT_MIN_SCALE
    pattern = "xx" + "x" * (n - 1) + "." + "x" * n  # 2 backoffs, n - 1 at the minimum, a good step, n more
    for step, outcome, warned in _fp16_overflowing_steps("skip", pattern):
        at_min = step > 2 and pattern[step - 1] == "x"
        count = step - 2 if step <= n + 1 else step - n - 2
        if at_min and count == n:
            assert isinstance(outcome, FloatingPointError), (step, outcome)
            assert f"optimizer step {step}: non-finite (inf/nan) fp16 gradients on pipeline stage(s) [1] at loss " \
                   f"scale 1, already at its minimum (min_scale); {n} steps in a row" in str(outcome), outcome
            assert step == len(pattern)
        else:
            assert not isinstance(outcome, Exception), (step, outcome)
            expected = [f"optimizer step {step}: non-finite (inf/nan) fp16 gradients on pipeline stage(s) [1] at "
                        f"loss scale 1, already at its minimum (min_scale); the step is skipped on every rank "
                        f"({count} in a row; on_nonfinite='skip' raises at {n})."]
            assert warned == (expected if at_min and dist.get_rank() == 0 else []), (step, warned)
    for step, outcome, warned in _fp16_overflowing_steps("raise", "xxx"):
        assert isinstance(outcome, FloatingPointError) == (step == 3), (step, outcome)
        assert not warned
    assert "on_nonfinite='raise'" in str(outcome)
    for step, outcome, warned in _fp16_overflowing_steps("ignore", "x" * (n + 3)):
        assert outcome is None and not warned, (step, outcome, warned)


class _CentralizedAdamW(torch.optim.AdamW):
    """Gradient centralization: subtracts each gradient's mean (over a whole tensor) before AdamW's update."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dim() > 1:
                    p.grad.sub_(p.grad.mean(dim=tuple(range(1, p.dim())), keepdim=True))
        return super().step(closure)


class _NamedAdamW(torch.optim.AdamW):
    """Only the constructor differs: AdamW's element-wise update."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, lr=lr, eps=1e-6)


def _check_zero_optimizer_subclasses():
    """ZeRO refuses a subclass of AdamW that overrides step (on every rank, before any collective: the group still
    trains), and accepts one that changes only its constructor, which then trains like AdamW."""
    model = mu.build("llama_lm", layers=2)
    booster = Booster(plugin=HybridParallelPlugin(zero_stage=1))
    with pytest.raises(TypeError, match="_CentralizedAdamW subclasses AdamW but overrides step, so its update may mix "
                                        "elements of a parameter"):
        booster.boost(model, _CentralizedAdamW(model.parameters()))
    params = []
    for make in (_NamedAdamW, lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-6)):
        model = mu.build("llama_lm", layers=2)
        booster = Booster(plugin=HybridParallelPlugin(zero_stage=1))
        model, opt, *_ = booster.boost(model, make(model.parameters()))
        batch = mu.make_batch("llama_lm", 2, dist.get_rank())
        booster.backward(mu.criterion(model(**batch), batch), opt)
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params)), "the accepted subclass trained differently from AdamW"


def _check_pp_styles_in_half_precision():
    """Llama (rotary) under every pp_style, 2 layers per chunk, trains a step in bf16 and fp16 with a loss close to
    one fp32 process's."""
    batch = mu.make_batch("llama_lm", 4, 0)
    for style, chunks in (("1f1b", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2)):
        reference = mu.build("llama_lm", layers=4 * chunks)
        with torch.no_grad():
            expected = mu.microbatch_mean_loss(reference, batch, 1)
        for precision in ("bf16", "fp16"):
            model = copy.deepcopy(reference)
            booster = Booster(plugin=HybridParallelPlugin(pp_size=2, pp_style=style, num_model_chunks=chunks,
                                                          precision=precision, num_microbatches=4))
            model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
            model.train()
            loss = booster.execute_pipeline(iter([batch]), model, mu.criterion, opt)["loss"]
            opt.step()
            mu.assert_close(loss.float(), expected, f"{style} {precision} loss", HALF_TOL)
            assert all(torch.isfinite(p).all() for p in model.parameters()), f"{style} {precision}: non-finite"


def _two_ranks():
    _check_tp_leaves_the_script_rng()
    _check_dp_draws_like_one_process()
    _check_fp16_stuck_at_min_scale()
    _check_zero_optimizer_subclasses()
    _check_pp_styles_in_half_precision()


def test_precision_and_rng_two_ranks():
    run_distributed(2, _two_ranks)
