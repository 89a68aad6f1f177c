"""LowLevelZeroPlugin(stage=1, 2) and TorchDDPPlugin: a ColossalAI training loop (gradient accumulation under
`booster.no_sync`, and without it) equals one process on the global batch, their HF checkpoints load with
`from_pretrained` and into the boosted model, TorchDDPPlugin's optimizer checkpoint restores the optimizer state
(2 ranks)."""
import contextlib
import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2LMHeadModel

from booster_plugin import Booster, DPPluginBase, LowLevelZeroPlugin, Plugin, TorchDDPPlugin
from tests import model_utils as mu
from tests.dist_utils import run_distributed

LOCAL_BATCH, STEPS = 4, 2
HALF = LOCAL_BATCH // 2


def _train(plugin: Plugin, directory: str) -> None:
    assert isinstance(plugin, DPPluginBase), type(plugin)
    rank, world = dist.get_rank(), dist.get_world_size()
    booster = Booster(plugin=plugin)
    reference = mu.build("gpt2_lm")
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    model = copy.deepcopy(reference)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6))
    for step in range(STEPS):
        batch = mu.make_batch("gpt2_lm", LOCAL_BATCH * world, seed=100 + step)
        # each rank accumulates two half batches (the first under no_sync); one process: the mean of every
        # replica's half-batch losses over the global batch
        halves = [{k: v[i * HALF:(i + 1) * HALF] for k, v in batch.items()} for i in range(2 * world)]
        ref_opt.zero_grad()
        torch.stack([mu.criterion(reference(**h), h) for h in halves]).mean().backward()
        ref_opt.step()
        # odd steps: without no_sync, each backward reduces its own part (as torch DDP and ColossalAI)
        with booster.no_sync(model, opt) if step % 2 == 0 else contextlib.nullcontext():
            booster.backward(mu.criterion(model(**halves[2 * rank]), None) / 2, opt)
            if isinstance(plugin, TorchDDPPlugin) and step % 2 == 0:  # not reduced: each rank holds its own
                grad = model.unwrap().transformer.wpe.weight.grad
                grads = [torch.empty_like(grad) for _ in range(world)]
                dist.all_gather(grads, grad)
                assert not torch.allclose(grads[0], grads[1]), "no_sync reduced the gradients"
        booster.backward(mu.criterion(model(**halves[2 * rank + 1]), None) / 2, opt)
        opt.step()
        opt.zero_grad()
    trained = {n: p.detach().clone() for n, p in reference.named_parameters()}
    checkpoint = os.path.join(directory, type(plugin).__name__ + str(getattr(plugin, "stage", "")))
    booster.save_model(model, checkpoint)
    loaded = GPT2LMHeadModel.from_pretrained(checkpoint)
    for name, p in loaded.named_parameters():
        mu.assert_close(p.data, trained[name], f"{type(plugin).__name__} {name} after {STEPS} steps, reloaded")
    with torch.no_grad():  # load_model restores the saved weights into the boosted model
        for p in model.parameters():
            p.zero_()
    booster.load_model(model, checkpoint)
    ours = model.unwrap()
    for name, p in ours.named_parameters():
        mu.assert_close(p.data, trained[name], f"{type(plugin).__name__} {name} after load_model")
    if isinstance(plugin, TorchDDPPlugin):  # torch's optimizer state_dict, through safetensors + JSON
        saved = copy.deepcopy(opt.state_dict())
        booster.save_optimizer(opt, checkpoint + "_optimizer")
        for state in opt.state.values():
            state["exp_avg"].zero_()
        booster.load_optimizer(opt, checkpoint + "_optimizer")
        loaded = opt.state_dict()
        assert loaded["param_groups"] == saved["param_groups"]
        for index, state in saved["state"].items():
            for key, value in state.items():
                mu.assert_close(loaded["state"][index][key], value, f"optimizer state {index}.{key}")


def _all(directory: str) -> None:
    _train(LowLevelZeroPlugin(stage=1), directory)
    _train(LowLevelZeroPlugin(stage=2), directory)
    ddp = TorchDDPPlugin()
    _train(ddp, directory)
    try:
        ddp.execute_pipeline(iter([]), None, None)
    except NotImplementedError as error:
        assert "no pipeline" in str(error)
    else:
        raise AssertionError("TorchDDPPlugin.execute_pipeline must be refused")


def test_dp_plugins_equal_one_process_and_save_hf_checkpoints():
    with tempfile.TemporaryDirectory() as directory:
        run_distributed(2, _all, directory)


def test_low_level_zero_refuses_result_changing_arguments():
    """Refused before any collective, naming the fix (ColossalAI asserts the first two)."""
    with pytest.raises(ValueError, match="stage 1 or 2"):
        LowLevelZeroPlugin(stage=3)
    with pytest.raises(NotImplementedError, match="norm_type=2.0"):
        LowLevelZeroPlugin(norm_type=1.0)
    with pytest.raises(NotImplementedError, match="master_weights=True"):
        LowLevelZeroPlugin(precision="bf16", master_weights=False)
    with pytest.raises(TypeError, match="HybridParallelPlugin"):
        LowLevelZeroPlugin(tp_size=2)
