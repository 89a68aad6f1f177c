"""One ColossalAI-style training script per plugin class, ported by the README's substitution rule alone, trains on 2
ranks equal to one process (fp32, 1e-5) and saves a checkpoint that `from_pretrained` loads: TorchDDPPlugin,
LowLevelZeroPlugin (stage 1 and 2), GeminiPlugin, TorchFSDPPlugin, HybridParallelPlugin and MoeHybridParallelPlugin."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import transformers

from tests import model_utils as mu
from tests.dist_utils import run_distributed
from tests.test_colossalai_mirror import _port

# ColossalAI's own idiom (its examples' train loop): the plugin is chosen by name, the model's loss is used, the
# pipeline plugins step through execute_pipeline; {plugin} is filled in per case.
SCRIPT = """\
import colossalai
from colossalai.booster import Booster
from colossalai.booster.plugin import (GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin,
                                       MoeHybridParallelPlugin, TorchDDPPlugin, TorchFSDPPlugin)
from colossalai.cluster import DistCoordinator
from colossalai.nn.optimizer import HybridAdam

coordinator = DistCoordinator()
plugin = {plugin}
booster = Booster(plugin=plugin)
optimizer = HybridAdam(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)
model, optimizer, _, _, _ = booster.boost(model, optimizer)
model.train()
losses = []
for batch in batches:
    if isinstance(plugin, HybridParallelPlugin) and plugin.pp_size > 1:
        loss = booster.execute_pipeline(iter([batch]), model, lambda out, _: out.loss, optimizer)["loss"]
    else:
        loss = model(**batch).loss
        booster.backward(loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(float(loss))
booster.save_model(model, checkpoint, shard=True)
coordinator.print_on_master("saved")
"""
PLUGINS = {
    "ddp": ("llama_lm", "TorchDDPPlugin()"),
    "zero1": ("llama_lm", "LowLevelZeroPlugin(stage=1)"),
    "zero2": ("llama_lm", "LowLevelZeroPlugin(stage=2)"),
    "gemini": ("llama_lm", "GeminiPlugin(precision='fp32')"),
    "fsdp": ("llama_lm", "TorchFSDPPlugin()"),
    "hybrid": ("llama_lm", "HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2)"),
    "moe": ("qwen3moe_lm", "MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2)"),
}


def _reference(kind: str, batches, dp: int, local: int, mb: int):
    """One process, AdamW (HybridAdam's update) on the global batches; the loss of each replica's part."""
    model = mu.build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.0)
    losses = []
    for batch in batches:
        opt.zero_grad()
        parts = [mu.microbatch_mean_loss(model, {k: v[r * local:(r + 1) * local] for k, v in batch.items()}, mb)
                 for r in range(dp)]
        torch.stack(parts).mean().backward()
        opt.step()
        losses.append([float(p) for p in parts])
    return model, losses


def _run(directory: str) -> None:
    import tests.test_expert_parallel  # noqa: F401  (registers "qwen3moe_lm")
    rank, dp, local = dist.get_rank(), dist.get_world_size(), 4
    for name, (kind, plugin) in PLUGINS.items():
        pp = "pp_size=2" in plugin
        replicas = 1 if pp else dp
        batches = [mu.make_batch(kind, local * replicas, seed=100 + s) for s in range(2)]
        mine = batches if pp else [{k: v[rank * local:(rank + 1) * local] for k, v in b.items()} for b in batches]
        checkpoint = os.path.join(directory, name)
        namespace = dict(model=mu.build(kind), batches=mine, checkpoint=checkpoint)
        exec(compile(_port(SCRIPT.format(plugin=plugin)), f"ported_{name}.py", "exec"), namespace)
        reference, ref_losses = _reference(kind, batches, replicas, local, local // 2 if pp else local)
        for step, loss in enumerate(namespace["losses"]):
            mu.assert_close(torch.tensor(loss), torch.tensor(ref_losses[step][0 if pp else rank]),
                            f"{name} step {step} loss")
        dist.barrier()
        if rank == 0:  # the checkpoint is the trained model, in HF format
            loaded = type(reference).from_pretrained(checkpoint)
            ref = dict(reference.named_parameters())
            for n, p in loaded.named_parameters():
                mu.assert_close(p.data, ref[n].data, f"{name}: from_pretrained {n}")
        dist.barrier()


def test_colossalai_script_per_plugin(tmp_path):
    run_distributed(2, _run, str(tmp_path))
