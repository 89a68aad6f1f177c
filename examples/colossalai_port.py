r"""A ColossalAI hybrid-parallel training script, ported by one substitution (README, "Porting a ColossalAI script"):

    sed -i -E 's/\bcolossalai\b/booster_plugin.colossalai/g' colossalai_port.py

The body is written as ColossalAI's examples are (launch_from_torch, DistCoordinator, HybridAdam, LazyInitContext,
get_accelerator, `stage_manager is None` branching, ColossalAI's plugin arguments including speed-only ones); the
substitution changed the imports and `colossalai.launch_from_torch` only.

    torchrun --nproc_per_node=8 examples/colossalai_port.py --tp 2 --pp 2      # tp=2 x pp=2 x dp=2
    torchrun --nproc_per_node=8 examples/colossalai_port.py --tp 2 --pp 2 --precision fp16 --zero-stage 1
"""
import argparse
from typing import List, Optional

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import booster_plugin.colossalai
from booster_plugin.colossalai.accelerator import get_accelerator
from booster_plugin.colossalai.booster import Booster
from booster_plugin.colossalai.booster.plugin import HybridParallelPlugin
from booster_plugin.colossalai.cluster import DistCoordinator
from booster_plugin.colossalai.lazy import LazyInitContext
from booster_plugin.colossalai.nn.optimizer import HybridAdam


def _criterion(outputs, inputs):
    return outputs.loss


def make_batches(steps: int, batch_size: int, seq: int, vocab: int, seed: int = 0) -> List[dict]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch_size, seq), generator=g)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return batches


def train(tp: int, pp: int, steps: int = 3, init_from: Optional[str] = None, save_to: Optional[str] = None,
          config: Optional[GPT2Config] = None, precision: str = "fp32", zero_stage: int = 0) -> List[float]:
    booster_plugin.colossalai.launch_from_torch(seed=42)
    coordinator = DistCoordinator()
    plugin = HybridParallelPlugin(tp_size=tp, pp_size=pp, num_microbatches=None, microbatch_size=1, zero_stage=zero_stage,
                                  precision=precision, initial_scale=2 ** 8, enable_all_optimization=True,
                                  enable_flash_attention=True, overlap_communication=True, find_unused_parameters=False,
                                  max_norm=1.0)
    booster = Booster(plugin=plugin)
    config = config or GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=4, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    with LazyInitContext(default_device=get_accelerator().get_current_device()):
        model = GPT2LMHeadModel(config)
    optimizer = HybridAdam(model.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, _criterion_, _, lr_scheduler = booster.boost(model, optimizer, criterion=_criterion,
                                                                  lr_scheduler=lr_scheduler)
    if init_from is not None:
        booster.load_model(model, init_from)  # e.g. pretrained weights in Hugging Face format

    # the data of one data-parallel replica (ColossalAI's examples use plugin.prepare_dataloader)
    world_batches = make_batches(steps, 4 * plugin.dp_size, 16, config.vocab_size)
    losses = []
    model.train()
    for step, batch in enumerate(world_batches):
        batch = {k: v[plugin.dp_rank * 4:(plugin.dp_rank + 1) * 4].to(get_accelerator().get_current_device())
                 for k, v in batch.items()}
        if booster.plugin.stage_manager is not None:
            outputs = booster.execute_pipeline(iter([batch]), model, _criterion, optimizer, return_loss=True)
            loss = outputs["loss"]
        else:
            outputs = model(**batch)
            loss = _criterion(outputs, None)
            booster.backward(loss, optimizer)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())  # the step's loss is on every rank
        coordinator.print_on_master(f"step {step} loss {loss.item():.4f} grad norm {optimizer.get_grad_norm():.4f}")
    if save_to is not None:  # written in the background while the script goes on
        booster.save_model(model, f"{save_to}/model", shard=True, use_async=True)
        booster.save_optimizer(optimizer, f"{save_to}/optimizer", shard=True, use_async=True)
        booster.checkpoint_io._sync_d2h()
        booster.checkpoint_io._sync_io()
        coordinator.block_all()
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save-to", default=None)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--zero-stage", type=int, default=0)
    args = parser.parse_args()
    train(args.tp, args.pp, args.steps, save_to=args.save_to, precision=args.precision, zero_stage=args.zero_stage)
