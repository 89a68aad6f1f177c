"""GeminiPlugin and TorchFSDPPlugin (torch FSDP2, 2 ranks) on a tiny Llama: AdamW steps equal one process on the
global batch (data split as prepare_dataloader splits it), the HF checkpoint loads with `from_pretrained` and gives
the trained model's logits, and a fresh plugin that loads the model, optimizer and lr scheduler checkpoints takes
the same next step as uninterrupted training."""
import json
import os
import tempfile
from typing import Callable, Dict

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import TensorDataset
from transformers import LlamaForCausalLM

from booster_plugin import Booster, DPPluginBase, GeminiPlugin, TorchFSDPPlugin
from booster_plugin.colossalai.booster.plugin import GeminiPlugin as MirrorGemini
from booster_plugin.colossalai.booster.plugin.torch_fsdp_plugin import TorchFSDPPlugin as MirrorFSDP
from booster_plugin.colossalai.testing import check_state_dict_equal
from pipeline.groups import world_group
from tests import model_utils as mu
from tests.dist_utils import run_distributed

LOCAL_BATCH, STEPS, LAYERS, MAX_NORM = 2, 3, 2, 1.0
PLUGINS: Dict[str, Callable[[], DPPluginBase]] = {
    "gemini": lambda: GeminiPlugin(max_norm=MAX_NORM),  # fp32 (ours; ColossalAI's default is fp16)
    "fsdp": lambda: TorchFSDPPlugin(),
}


def _dataset(size: int) -> TensorDataset:
    ids = torch.randint(1, mu.VOCAB, (size, mu.SEQ), generator=torch.Generator().manual_seed(7))
    return TensorDataset(ids)  # no padding: every sample has as many loss tokens


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.to(mu.DEVICE)
    return model(input_ids=ids, labels=ids).loss


def _boost(kind: str, seed: int):
    plugin = PLUGINS[kind]()
    assert isinstance(plugin, DPPluginBase)
    booster = Booster(plugin=plugin)
    model = mu.build("llama_lm", LAYERS, seed=seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.9)
    model, optim, _, _, scheduler = booster.boost(model, optim, lr_scheduler=scheduler)
    return plugin, booster, model, optim, scheduler


def _step(booster: Booster, model, optim, scheduler, ids: torch.Tensor) -> torch.Tensor:
    loss = _loss(model, ids)
    booster.backward(loss, optim)
    optim.step()
    optim.zero_grad()
    scheduler.step()
    return loss.detach()


def _full_state(model) -> Dict[str, torch.Tensor]:
    """Every rank: the boosted model's full parameters (torch's gather)."""
    return get_model_state_dict(model.unwrap(), options=StateDictOptions(full_state_dict=True))


def _train_save_resume(kind: str, directory: str) -> None:
    world = dist.get_world_size()
    global_batch = LOCAL_BATCH * world
    data = _dataset(global_batch * (STEPS + 1))
    reference = mu.build("llama_lm", LAYERS).to(mu.DEVICE)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_optim, step_size=1, gamma=0.9)
    plugin, booster, model, optim, scheduler = _boost(kind, seed=0)
    loader = iter(plugin.prepare_dataloader(data, batch_size=LOCAL_BATCH))
    for step in range(STEPS):
        ref_optim.zero_grad()
        ref_loss = _loss(reference, data.tensors[0][step * global_batch:(step + 1) * global_batch])
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM) if kind == "gemini" else None
        ref_optim.step()
        ref_sched.step()
        loss = _step(booster, model, optim, scheduler, next(loader)[0])
        dist.all_reduce(loss, group=world_group())  # (the world group may have no CPU backend)
        mu.assert_close(loss / world, ref_loss.detach(), f"{kind} loss at step {step}")
        if ref_norm is not None:
            mu.assert_close(torch.tensor(optim.get_grad_norm()), ref_norm.cpu(), f"{kind} grad norm at step {step}")
    trained = _full_state(model)
    for name, p in reference.named_parameters():
        mu.assert_close(trained[name], p.detach(), f"{kind} {name} after {STEPS} steps")
    if kind == "gemini":  # ColossalAI's GeminiDDP.state_dict: whole tensors, own names; rank 0 only by default
        everywhere, on_rank_0 = model.state_dict(only_rank_0=False), model.state_dict()
        assert set(everywhere) == set(reference.state_dict()), sorted(everywhere)
        for name, p in reference.named_parameters():
            mu.assert_close(everywhere[name], p.detach(), f"gemini state_dict(only_rank_0=False) {name}")
        assert set(on_rank_0) == (set(everywhere) if dist.get_rank() == 0 else set()), sorted(on_rank_0)

    # HF checkpoint: shard=True a directory with an index, shard=False one model.safetensors
    shard = kind == "gemini"
    checkpoint = os.path.join(directory, kind)
    booster.save_model(model, checkpoint, shard=shard, size_per_shard=0.02)
    files = sorted(os.listdir(checkpoint))
    if shard:
        index = json.load(open(os.path.join(checkpoint, "model.safetensors.index.json")))
        assert len(set(index["weight_map"].values())) > 1, files
    else:
        assert "model.safetensors" in files and not any(f.endswith("index.json") for f in files), files
    loaded = LlamaForCausalLM.from_pretrained(checkpoint).to(mu.DEVICE)
    ids = data.tensors[0][:global_batch].to(mu.DEVICE)
    with torch.no_grad():
        mu.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, f"{kind} reloaded logits")
    booster.save_optimizer(optim, checkpoint + "_optimizer")
    booster.save_lr_scheduler(scheduler, checkpoint + "_scheduler.json")

    # uninterrupted: one more step; resumed: a fresh plugin, model (other init) and optimizer load the checkpoints
    batch = next(loader)[0]
    _step(booster, model, optim, scheduler, batch)
    _, booster2, model2, optim2, scheduler2 = _boost(kind, seed=1)
    booster2.load_model(model2, checkpoint)
    booster2.load_optimizer(optim2, checkpoint + "_optimizer")
    booster2.load_lr_scheduler(scheduler2, checkpoint + "_scheduler.json")
    _step(booster2, model2, optim2, scheduler2, batch)
    resumed, uninterrupted = _full_state(model2), _full_state(model)
    for name, value in uninterrupted.items():
        mu.assert_close(resumed[name], value, f"{kind} {name}: resumed step vs uninterrupted", tol=1e-6)
    assert all(type(g["betas"]) is tuple for g in optim2.param_groups)  # as saved (torch's loader makes lists)
    if kind == "gemini":  # ColossalAI's GeminiOptimizer.state_dict(only_rank_0=False): whole, on every rank
        check_state_dict_equal(optim2.state_dict(only_rank_0=False), optim.state_dict(only_rank_0=False))
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()


def _precisions() -> None:
    """bf16 / fp16 compute (fp32 master weights and reduction; fp16 with the loss scaler): one step's loss is one
    process's up to the half-precision rounding, and the fp16 loss scale is saved with the optimizer."""
    data = _dataset(LOCAL_BATCH * dist.get_world_size())
    reference = _loss(mu.build("llama_lm", LAYERS), data.tensors[0]).detach()
    for precision in ("bf16", "fp16"):
        plugin = GeminiPlugin(precision=precision)
        booster = Booster(plugin=plugin)
        model = mu.build("llama_lm", LAYERS)
        model, optim, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        ids = next(iter(plugin.prepare_dataloader(data, batch_size=LOCAL_BATCH)))[0]
        loss = _loss(model, ids)
        booster.backward(loss, optim)
        optim.step()
        loss = loss.detach().float()
        dist.all_reduce(loss, group=world_group())  # (the world group may have no CPU backend)
        mu.assert_close(loss / dist.get_world_size(), reference, f"{precision} loss", tol=2e-2)
        assert (optim.scaler is not None) == (precision == "fp16")


def _check_optimizer_not_boosted_is_refused(kind: str) -> None:
    """An optimizer built after boost, or the original object stepped instead of the boosted one, would skip the
    plugin's step (Gemini's clipping, loss scaling): refused at its step, as HybridParallelPlugin refuses it; and
    booster.backward with one names the fix."""
    plugin = PLUGINS[kind]()
    booster = Booster(plugin=plugin)
    model = mu.build("llama_lm", LAYERS)
    original = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, *_ = booster.boost(model, original)
    ids = _dataset(LOCAL_BATCH).tensors[0]
    for stray in (torch.optim.AdamW(model.parameters(), lr=1e-3), original):
        with pytest.raises(TypeError, match="booster.backward needs the optimizer booster.boost returned"):
            booster.backward(_loss(model, ids), stray)
        booster.backward(_loss(model, ids), opt)
        with pytest.raises(RuntimeError, match="did not go through booster.boost"):
            stray.step()
        opt.step()  # the boosted one steps
        opt.zero_grad()


def _all(directory: str) -> None:
    for kind in PLUGINS:
        _train_save_resume(kind, directory)
        _check_optimizer_not_boosted_is_refused(kind)
    _precisions()


def test_fsdp_plugins_equal_one_process_and_checkpoint():
    with tempfile.TemporaryDirectory() as directory:
        run_distributed(2, _all, directory)


def test_fsdp_plugins_refuse_result_changing_arguments():
    """Refused before any collective, naming the reason; the ColossalAI module paths hold the same classes."""
    from torch.distributed.fsdp import MixedPrecision
    assert MirrorGemini is GeminiPlugin and MirrorFSDP is TorchFSDPPlugin
    with pytest.raises(NotImplementedError, match="master_weights=True"):
        GeminiPlugin(precision="bf16", master_weights=False)
    with pytest.raises(NotImplementedError, match="norm_type=2.0"):
        GeminiPlugin(max_norm=1.0, norm_type=1.0)
    with pytest.raises(NotImplementedError, match="HybridParallelPlugin"):
        GeminiPlugin(tp_size=2)
    with pytest.raises(ValueError, match="'fp32', 'bf16' or 'fp16'"):
        GeminiPlugin(precision="fp8")
    with pytest.raises(NotImplementedError, match="drift apart"):
        TorchFSDPPlugin(ignored_modules=[torch.nn.Linear(1, 1)])
    with pytest.raises(NotImplementedError, match="LazyInitContext"):
        TorchFSDPPlugin(param_init_fn=lambda module: None)
    with pytest.raises(NotImplementedError, match="keep_low_precision_grads"):
        TorchFSDPPlugin(mixed_precision=MixedPrecision(torch.bfloat16, keep_low_precision_grads=True))
    with pytest.raises(NotImplementedError, match="buffer_dtype"):
        TorchFSDPPlugin(mixed_precision=MixedPrecision(torch.bfloat16, buffer_dtype=torch.bfloat16))
