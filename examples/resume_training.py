"""Fault-tolerant training: a checkpoint every few steps, and automatic resume from the newest complete one.

    torchrun --nproc_per_node=4 --max-restarts=3 examples/resume_training.py --ckpt-dir out/resume --steps 20

When a rank dies (killed, out of memory, a node lost), the others stop (their collectives fail, or the failure
watchdog ends them) and torchrun restarts every rank; each then loads the newest checkpoint whose `COMPLETE` marker
exists and goes on from the step after it, on the same data. A checkpoint is complete only after the model,
optimizer and scheduler are written (each save is atomic); a crash in the middle of one leaves the previous one.
`--kill-rank R --kill-at-step K` kills rank R at step K of the first attempt (to try it; the test does).
"""
import argparse
import json
import os
import re
import signal
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from booster_plugin import Booster, HybridParallelPlugin, world_group

COMPLETE = "COMPLETE"


def model_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def batch_of_step(step: int, batch_size: int, seq: int = 16) -> dict:
    """The global batch of `step`: deterministic, so a resumed run sees the data an uninterrupted one would."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, model_config().vocab_size, (batch_size, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def newest_complete(ckpt_dir: str) -> Optional[Tuple[int, str]]:
    """(step, path) of the newest checkpoint with its COMPLETE marker."""
    found = []
    for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []:
        m = re.fullmatch(r"step-(\d+)", name)
        if m and os.path.exists(os.path.join(ckpt_dir, name, COMPLETE)):
            found.append((int(m.group(1)), os.path.join(ckpt_dir, name)))
    return max(found) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="per data-parallel replica")
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=120, help="process-group timeout in seconds")
    args = parser.parse_args()
    torch.set_num_threads(1)

    plugin = HybridParallelPlugin(tp_size=args.tp, pp_size=args.pp, num_microbatches=2, max_norm=1.0,
                                  timeout=args.timeout)
    booster = Booster(plugin=plugin)
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    start = 0
    resume = newest_complete(args.ckpt_dir)
    if resume is not None:
        step, path = resume
        booster.load_model(model, os.path.join(path, "model"))
        booster.load_optimizer(optimizer, os.path.join(path, "optimizer"))
        booster.load_lr_scheduler(scheduler, os.path.join(path, "scheduler.json"))
        start = step + 1
    if dist.get_rank() == 0:
        print(f"attempt {attempt}: starting at step {start}", flush=True)

    losses = {}
    for step in range(start, args.steps):
        if attempt == 0 and step == args.kill_at_step and dist.get_rank() == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)  # a rank dies mid-training
        batch = batch_of_step(step, args.batch_size * plugin.dp_size)
        local = {k: v[plugin.dp_rank * args.batch_size:(plugin.dp_rank + 1) * args.batch_size] for k, v in batch.items()}
        loss = booster.execute_pipeline(iter([local]), model, lambda out, mb: out.loss, optimizer)["loss"]
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses[step] = loss.item()
        if dist.get_rank() == 0:
            print(f"step {step} loss {losses[step]:.6f}", flush=True)
        if (step + 1) % args.save_every == 0:
            path = os.path.join(args.ckpt_dir, f"step-{step}")
            booster.save_model(model, os.path.join(path, "model"))
            booster.save_optimizer(optimizer, os.path.join(path, "optimizer"))
            booster.save_lr_scheduler(scheduler, os.path.join(path, "scheduler.json"))
            dist.barrier(group=world_group())
            if dist.get_rank() == 0:
                open(os.path.join(path, COMPLETE), "w").close()
    if dist.get_rank() == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        with open(os.path.join(args.ckpt_dir, f"losses-attempt-{attempt}.json"), "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
