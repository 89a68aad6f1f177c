"""Memory and precision options against the unsharded model: ZeRO-1/2 (exact, fp32), fp16 with dynamic loss
scaling and bf16 (mixed-precision tolerance), a forced overflow skipped on every rank, activation checkpointing
(equal to no checkpointing, also with sequence parallelism), checkpoints across zero stages, and refusals of what
cannot work. (Sequence parallelism against the unsharded model: tests/test_tensor_parallel.py.)"""
import os

import pytest
import torch
import torch.distributed as dist

from booster_plugin import Booster, GradientCheckpointConfig, HybridParallelPlugin
from booster_plugin.core.mixed_precision import DynamicLossScaler, LossScalerConfig
from tests import model_utils as mu
from tests.dist_utils import run_distributed

MIXED_TOL = 2e-2  # fp16/bf16 compute against the fp32 reference, two AdamW steps at lr 1e-3


# -- pure logic -------------------------------------------------------------------------------------------------
def test_loss_scaler_follows_hysteresis_growth_and_bounds():
    s = DynamicLossScaler(LossScalerConfig(initial_scale=8, growth_interval=2, hysteresis=2, min_scale=2,
                                           max_scale=16), torch.device("cpu"))
    s.update(True)
    assert s.scale == 8  # first overflow: hysteresis keeps the scale
    s.update(True)
    assert s.scale == 4
    s.update(True)
    assert s.scale == 2
    s.update(True)
    assert s.scale == 2  # min_scale
    s.update(False)
    s.update(False)
    assert s.scale == 4 and s.hysteresis_step == 0
    for _ in range(6):
        s.update(False)
    assert s.scale == 16  # max_scale
    restored = DynamicLossScaler(LossScalerConfig(), torch.device("cpu"))
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == s.state_dict()


def test_loss_scaler_unscales_and_detects_non_finite():
    s = DynamicLossScaler(LossScalerConfig(initial_scale=4), torch.device("cpu"))
    g = [torch.tensor([4.0, 8.0])]
    assert not s.unscale_and_check(g) and g[0].tolist() == [1.0, 2.0]
    assert s.unscale_and_check([torch.tensor([1.0, float("inf")])])
    assert s.unscale_and_check([torch.tensor([float("nan")])])


# -- 2 ranks -------------------------------------------------------------------------------------------------------
def _zero_cases():
    for stage in (1, 2):
        # (1,1,2) with clipping, and with gradient accumulation over 2 microbatches (no reduction until the last)
        mu.check_training("gpt2_lm", zero_stage=stage, max_norm=0.05)
        mu.check_training("llama_lm", zero_stage=stage, num_microbatches=2)
        mu.check_training("bert", zero_stage=stage)  # an unused parameter (pooler): no gradient, not stepped


def _refusals():
    # not refused: ZeRO over dp size 1 partitions nothing and trains as zero_stage=0 (as ColossalAI runs it)
    mu.check_training("gpt2_lm", tp_size=2, zero_stage=1)
    mu.check_training("gpt2_lm", pp_size=2, num_microbatches=2, zero_stage=2, precision="bf16", tol=MIXED_TOL)
    with pytest.raises(ValueError, match="zero_stage=3"):
        HybridParallelPlugin(zero_stage=3)
    with pytest.raises(ValueError, match="growth_factor=1"):
        HybridParallelPlugin(precision="fp16", growth_factor=1)
    plugin = HybridParallelPlugin(zero_stage=2)
    model = mu.build("gpt2_lm")
    with pytest.raises(TypeError, match="LBFGS is not one of the element-wise optimizers"):
        Booster(plugin=plugin).boost(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(ValueError, match=r"num_ckpt_layers_per_stage=\[1, 1\] must hold pp_size=1"):
        HybridParallelPlugin(gradient_checkpoint_config=GradientCheckpointConfig(num_ckpt_layers_per_stage=[1, 1]))
    plugin = HybridParallelPlugin(gradient_checkpoint_config=GradientCheckpointConfig(num_ckpt_layers_per_stage=[5]))
    with pytest.raises(ValueError, match="more checkpointed layers than they hold: stage 0: 5 of 4"):
        Booster(plugin=plugin).boost(mu.build("gpt2_lm"))


def _mixed_precision_cases():
    mu.check_training("llama_lm", precision="fp16", max_norm=1.0, tol=MIXED_TOL)
    mu.check_training("gpt2_lm", precision="fp16", zero_stage=2, tol=MIXED_TOL)
    mu.check_training("llama_lm", precision="bf16", zero_stage=1, tol=MIXED_TOL)
    # zbv: the split backward's I is the loss-scaled backward too
    mu.check_training("llama_lm", pp_size=2, num_microbatches=2, pp_style="zbv", num_model_chunks=2, precision="fp16",
                      tol=MIXED_TOL)


def _forced_overflow(**plugin_kwargs):
    """An inf gradient on one rank only (global rank 1): every rank skips the step, replicas stay identical, the
    scale backs off after `hysteresis` overflows; a good step then trains."""
    for zero_stage in (0, 2):
        plugin = HybridParallelPlugin(precision="fp16", zero_stage=zero_stage, initial_scale=2 ** 10, hysteresis=2,
                                      **plugin_kwargs)
        booster = Booster(plugin=plugin)
        model = mu.build("llama_lm")
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        before = [p.detach().clone() for p in model.parameters()]
        batch = mu.make_batch("llama_lm", 4, seed=plugin.dp_rank)

        def train_step(overflow: bool):
            opt.zero_grad()
            hooks = [p.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
                     for p in list(model.parameters())[:1] if overflow and dist.get_rank() == 1]
            if plugin.schedule is not None:  # in backward: before the dp reduction
                booster.execute_pipeline(iter([batch]), model, mu.criterion, opt)
            else:
                booster.backward(mu.criterion(model(**batch), batch), opt)
            for h in hooks:
                h.remove()
            return opt.step()

        for overflow_step in range(2):
            assert train_step(overflow=True) is None
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a skipped step changed weights"
            assert opt.scaler.scale == (2 ** 10 if overflow_step == 0 else 2 ** 9)
        train_step(overflow=False)
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the good step did not train"
        flat = torch.cat([p.detach().float().view(-1) for p in model.parameters()])
        others = [torch.empty_like(flat) for _ in range(plugin.dp_size)]
        dist.all_gather(others, flat, group=plugin.dp_group)
        assert all(torch.equal(flat, o) for o in others), "replicas differ"


def _train_with_dropout(kind: str, config: "GradientCheckpointConfig | None", steps: int = 2, **plugin_kwargs):
    """Train `kind` with dropout everywhere; returns (losses, this rank's parameters, attention forward calls)."""
    model = mu.build(kind)
    for name in ("attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout"):
        if hasattr(model.config, name):
            setattr(model.config, name, 0.1)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1
    torch.manual_seed(1234 + dist.get_rank())  # (tp > 1 re-seeds from the plugin's seed)
    plugin = HybridParallelPlugin(gradient_checkpoint_config=config, **plugin_kwargs)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6))
    model.train()
    calls = [0]
    for name, module in model.unwrap().named_modules():
        if name.rpartition(".")[2] in ("attn", "self_attn"):
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    losses = []
    for step in range(steps):
        batch = mu.make_batch(kind, 8, seed=10 * step + plugin.dp_rank)
        opt.zero_grad()
        if plugin.schedule is not None:
            losses.append(booster.execute_pipeline(iter([batch]), model, mu.criterion, opt)["loss"])
        else:
            loss = mu.criterion(model(**batch), batch)
            booster.backward(loss, opt)
            losses.append(loss.detach())
        opt.step()
    return losses, [p.detach().clone() for p in model.parameters()], calls[0]


def check_activation_checkpointing(kind: str, config: GradientCheckpointConfig, recomputed_layers: int,
                                   steps: int = 2, **plugin_kwargs) -> None:
    """With dropout (tp: per-rank masks on split heads), checkpointing trains exactly like no checkpointing, and
    this stage recomputed `recomputed_layers` layers per microbatch."""
    losses, params, calls = _train_with_dropout(kind, None, steps, **plugin_kwargs)
    ck_losses, ck_params, ck_calls = _train_with_dropout(kind, config, steps, **plugin_kwargs)
    microbatches = steps * plugin_kwargs.get("num_microbatches", 1)
    assert ck_calls - calls == recomputed_layers * microbatches, (ck_calls, calls)
    for a, b in zip(ck_losses, losses):
        mu.assert_close(a, b, f"{kind} loss with activation checkpointing")
    for a, b in zip(ck_params, params):
        mu.assert_close(a, b, f"{kind} parameters with activation checkpointing")


def _activation_checkpointing_cases():
    # (with dropout the two runs' gradients already differ by ~1e-8 in fp32, full loss or chunked; AdamW at lr 1e-2
    # can lift one near-zero element past 1e-5, which the chunked loss's rounding does here: the full loss's is kept)
    check_activation_checkpointing("gpt2_lm", GradientCheckpointConfig(), 4, tp_size=2, chunked_loss=False)
    # regions of several column layers (q, k, v; gate, up) whose weight gradients the region entry computes
    check_activation_checkpointing("llama_lm", GradientCheckpointConfig(), 4, tp_size=2)
    # zbv: the recomputation binds the linear layers to the forward's weight-gradient store (the same saved tensors),
    # and W delivers to the parameters themselves, not to the recomputed copies
    # both chunks of a rank count as its stage: all 2 held layers are checkpointed, and a per-stage count of 1
    check_activation_checkpointing("llama_lm", GradientCheckpointConfig(), 2, pp_size=2, num_microbatches=2,
                                   pp_style="zbv", num_model_chunks=2)
    check_activation_checkpointing("llama_lm", GradientCheckpointConfig(num_ckpt_layers_per_stage=[1, 1]), 1,
                                   pp_size=2, num_microbatches=2, pp_style="zbv", num_model_chunks=2)
    # dualpipev: whole backwards (B) of recomputed regions next to split ones
    check_activation_checkpointing("llama_lm", GradientCheckpointConfig(), 2, pp_size=2, num_microbatches=4,
                                   pp_style="dualpipev", num_model_chunks=2)
    # sequence parallelism: dropout on the sequence shard draws per-rank masks, recomputed identically
    check_activation_checkpointing("gpt2_lm", GradientCheckpointConfig(), 4, tp_size=2, enable_sequence_parallelism=True)
    # exact against the unsharded model too (no dropout), with ZeRO-2 and clipping
    mu.check_training("llama_lm", zero_stage=2, max_norm=0.05,
                      gradient_checkpoint_config=GradientCheckpointConfig(gradient_checkpointing_ratio=0.5))


def _train_steps(booster, model, opt, kind: str, steps: range) -> None:
    for step in steps:
        batch = mu.make_batch(kind, 8, seed=100 + 10 * step + booster.plugin.dp_rank)
        opt.zero_grad()
        booster.backward(mu.criterion(model(**batch), batch), opt)
        opt.step()


def _check_checkpoint_across_zero_stages(directory: str) -> None:
    """Save at one zero_stage, load at the others: the next steps equal those of the run that was not stopped;
    the fp16 loss scaler's state comes back with the optimizer."""
    kind = "llama_lm"
    for precision, saved_stage, tol in (("fp32", 2, 1e-5), ("fp16", 1, 1e-3)):
        scaler = dict(initial_scale=2 ** 8, growth_interval=1) if precision == "fp16" else {}
        runs = []
        for stage in (saved_stage, 0, 1, 2):
            booster = Booster(plugin=HybridParallelPlugin(zero_stage=stage, precision=precision, **scaler))
            model = mu.build(kind)
            model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6))
            if not runs:  # the saved run
                _train_steps(booster, model, opt, kind, range(2))
                booster.save_model(model, os.path.join(directory, precision, "model"))
                booster.save_optimizer(opt, os.path.join(directory, precision, "optim"))
                saved_scale = opt.scaler.scale if opt.scaler is not None else None
            else:
                booster.load_model(model, os.path.join(directory, precision, "model"))
                booster.load_optimizer(opt, os.path.join(directory, precision, "optim"))
                if saved_scale is not None:
                    assert opt.scaler.scale == saved_scale == 2 ** 10, (opt.scaler.scale, saved_scale)
            _train_steps(booster, model, opt, kind, range(2, 4))
            runs.append([p.detach().float().clone() for p in model.parameters()])
        for stage, params in zip((0, 1, 2), runs[1:]):
            for a, b in zip(params, runs[0]):
                mu.assert_close(a, b, f"{precision}: zero_stage={saved_stage} saved, {stage} loaded", tol)


def test_two_ranks(tmp_path):
    run_distributed(2, _two_rank_cases, str(tmp_path))


def _two_rank_cases(directory: str):
    _check_checkpoint_across_zero_stages(directory)
    # saved with all_to_all sequence parallelism (replicated layers), resumed with split_gather (tp-split layers)
    sp = dict(tp_size=2, enable_sequence_parallelism=True)
    mu.check_training("llama_lm", sequence_parallelism_mode="all_to_all", save_to=f"{directory}/sp", **sp)
    mu.check_training("llama_lm", steps=4, resume_from=(f"{directory}/sp", 2), **sp)
    _refusals()
    _zero_cases()
    _mixed_precision_cases()
    _forced_overflow()
    _activation_checkpointing_cases()


# -- 4 ranks -------------------------------------------------------------------------------------------------------
def _four_rank_cases(directory: str):
    # saved at (2,1,2) with ZeRO-2, resumed at (1,2,2) with ZeRO-1: equal to the unsharded model trained throughout
    mu.check_training("llama_lm", tp_size=2, num_microbatches=2, zero_stage=2, save_to=directory)
    mu.check_training("llama_lm", steps=4, pp_size=2, num_microbatches=2, zero_stage=1, resume_from=(directory, 2))
    for stage in (1, 2):
        mu.check_training("gpt2_lm", tp_size=2, zero_stage=stage, max_norm=0.05)
        mu.check_training("gpt2_lm", pp_size=2, num_microbatches=2, zero_stage=stage, max_norm=0.05)
    # fp16/bf16 with tp and pp; the loss scale applies in the last stage's backward and between stages
    mu.check_training("gpt2_lm", precision="fp16", pp_size=2, num_microbatches=2, zero_stage=2, max_norm=1.0,
                      tol=MIXED_TOL)
    mu.check_training("llama_lm", precision="fp16", tp_size=2, zero_stage=1, tol=MIXED_TOL)
    mu.check_training("llama_lm", precision="bf16", pp_size=2, num_microbatches=2, zero_stage=2, tol=MIXED_TOL)
    _forced_overflow(pp_size=2, num_microbatches=2)  # rank 1: stage 1 of replica 0
    # stage 0 checkpoints 1 of its 2 layers, stage 1 both; the stage-exit hook ends stage 0's forward
    config = GradientCheckpointConfig(num_ckpt_layers_per_stage=[1, 2])
    check_activation_checkpointing("llama_lm", config, [1, 2][dist.get_rank() // 2], tp_size=2, pp_size=2,
                                   num_microbatches=2)
    check_activation_checkpointing("gpt2_lm", config, [1, 2][dist.get_rank() // 2], tp_size=2, pp_size=2,
                                   num_microbatches=2)
    check_activation_checkpointing("llama_lm", config, [1, 2][dist.get_rank() // 2], tp_size=2, pp_size=2,
                                   num_microbatches=2, enable_sequence_parallelism=True,
                                   sequence_parallelism_mode="all_to_all")


def test_four_ranks(tmp_path):
    run_distributed(4, _four_rank_cases, str(tmp_path))


# -- 8 ranks: (2,2,2), run inside test_pipeline.py's 8-rank group (one group start less) -----------------------------
def eight_rank_cases():
    for stage in (1, 2):
        mu.check_training("llama_lm", tp_size=2, pp_size=2, num_microbatches=2, zero_stage=stage, max_norm=0.05)
