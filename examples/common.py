"""Shared pieces of the examples: flags, the default parallel layout, seeding, the training loop, checkpoints."""
from __future__ import annotations

import argparse
import math
import os
import random
import time
from typing import List, Tuple

import torch
import torch.distributed as dist
import transformers
from tqdm import tqdm

from booster_plugin import Booster, HybridParallelPlugin, world_group
from data import lm_datasets


def get_parser(description: str, steps: int = 80, batch_size: int = 16, seq_len: int = 128, lr: float = 2e-3,
               out: str = "out") -> argparse.ArgumentParser:
    """The flags every example shares; --tp/--pp default to default_layout(world size)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: by world size)")
    p.add_argument("--pp", type=int, default=None, help="pipeline parallel size (default: by world size)")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default: 4 if pp > 1)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=batch_size, help="per data-parallel replica")
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    p.add_argument("--out", default=out, help="output folder (checkpoint, tokenizer)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--trace-dir", default=None, help="record the pipeline schedule and write its timeline here")
    return p


def default_layout(world_size: int) -> Tuple[int, int]:
    """(tp, pp) for a world: 1 -> (1, 1), 2 -> (1, 2), 4 -> (2, 2), 8 -> (2, 2) with dp = 2; odd -> (1, 1)."""
    if world_size % 4 == 0:
        return 2, 2
    if world_size % 2 == 0:
        return 1, 2
    return 1, 1


def init_distributed() -> None:
    """Join torchrun's process group (a world of one when started with plain `python`)."""
    if not dist.is_initialized():
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29512")):
            os.environ.setdefault(key, value)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def is_main() -> bool:
    return dist.get_rank() == 0


def log(*args) -> None:
    """print on global rank 0 only."""
    if is_main():
        print(*args, flush=True)


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def setup(args: argparse.Namespace) -> Tuple[Booster, HybridParallelPlugin]:
    """Process group, threads, seed and layout; returns (booster, plugin). Sets args.tp/pp/microbatches."""
    init_distributed()
    if not is_main():  # one copy of transformers' load reports and warnings is enough
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # one thread per rank: the ranks share the CPU cores
    seed_all(args.seed)
    world = dist.get_world_size()
    if args.tp is None and args.pp is None:
        args.tp, args.pp = default_layout(world)
    args.tp, args.pp = args.tp or 1, args.pp or 1
    if args.microbatches is None and args.pp > 1:
        args.microbatches = 4
    plugin = HybridParallelPlugin(tp_size=args.tp, pp_size=args.pp, num_microbatches=args.microbatches,
                                  precision=args.precision, max_norm=args.max_norm, seed=args.seed,
                                  trace=True if args.trace_dir else None)  # None: HP_TRACE decides
    log(f"world {world}: tp={args.tp} pp={args.pp} dp={plugin.dp_size} microbatches={args.microbatches} "
        f"precision={args.precision}")
    return Booster(plugin=plugin), plugin


def uses_pipeline(args: argparse.Namespace) -> bool:
    """Steps go through execute_pipeline when pp > 1 or microbatches were asked for."""
    return args.pp > 1 or args.microbatches is not None


def dp_mean(value: torch.Tensor, plugin: HybridParallelPlugin) -> float:
    """Mean of a scalar over the data-parallel replicas (for logging)."""
    value = value.detach().float().clone()
    if plugin.dp_size > 1:
        dist.all_reduce(value, group=plugin.dp_group)
        value /= plugin.dp_size
    return value.item()


def train_step(booster, args, model, optimizer, criterion, batch) -> torch.Tensor:
    """Forward, backward and optimizer step on one batch; returns the loss (on every rank)."""
    if uses_pipeline(args):
        loss = booster.execute_pipeline(iter([batch]), model, criterion, optimizer, return_loss=True)["loss"]
    else:
        loss = criterion(model(**batch), batch)
        booster.backward(loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def train(booster, plugin, args, model, optimizer, criterion, dataloader, lr_scheduler=None,
          desc: str = "train") -> List[float]:
    """`args.steps` steps (cycling over epochs) with a progress bar on rank 0; returns the losses."""
    device = plugin.device
    tokens_per_step = args.batch_size * args.seq_len * plugin.dp_size  # over all replicas
    losses: List[float] = []
    bar = tqdm(total=args.steps, desc=desc, disable=not is_main(), dynamic_ncols=True)
    model.train()
    start, epoch = time.perf_counter(), 0
    while len(losses) < args.steps:
        if hasattr(dataloader.sampler, "set_epoch"):
            dataloader.sampler.set_epoch(epoch)
        for batch in dataloader:
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = train_step(booster, args, model, optimizer, criterion, batch)
            if lr_scheduler is not None:
                lr_scheduler.step()
            losses.append(dp_mean(loss, plugin))
            elapsed = time.perf_counter() - start
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step * len(losses) / elapsed:.0f}")
            bar.update()
            if len(losses) == args.steps:
                break
        epoch += 1
    bar.close()
    return losses


@torch.no_grad()
def evaluate_loss(booster, plugin, args, model, criterion, dataloader, max_batches: int = 20) -> float:
    """Mean loss over (up to `max_batches` of) a dataloader, averaged over data parallel; on every rank."""
    model.eval()
    total, n = 0.0, 0
    for i, batch in enumerate(dataloader):
        if i == max_batches:
            break
        batch = {k: v.to(plugin.device) for k, v in batch.items()}
        if uses_pipeline(args):
            loss = booster.execute_pipeline(iter([batch]), model, criterion, return_loss=True)["loss"]
        else:
            loss = criterion(model(**batch), batch)
        total, n = total + dp_mean(loss, plugin), n + 1
    model.train()
    return total / max(n, 1)


def warmup_cosine(optimizer, steps: int, warmup: int = 10) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine decay to 10% of the peak learning rate."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def save_checkpoint(booster, model, path: str) -> bool:
    """Save the whole (unsharded) model as a Hugging Face folder if the booster can; True when saved."""
    if not hasattr(booster, "save_model"):
        log("booster.save_model is not available yet: checkpoint not saved.")
        return False
    booster.save_model(model, path, shard=True, use_safetensors=True)
    dist.barrier(group=world_group())  # every rank's shard is written before anyone reads the folder
    log(f"checkpoint saved to {path}")
    return True


def generate_from_checkpoint(path: str, prompt: str, max_new_tokens: int = 30) -> None:
    """Rank 0 reloads the saved folder with plain transformers and continues `prompt` (top-k sampling)."""
    if not is_main():
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path).float().eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=20, temperature=0.8,
                             pad_token_id=tokenizer.pad_token_id)
    print(f"--- generated from {path} ---\n{tokenizer.decode(out[0], skip_special_tokens=True)}\n---", flush=True)


def write_trace(args, plugin) -> None:
    """With --trace-dir: write the recorded schedule (trace.json, timeline.png, bubble.json); collective."""
    if args.trace_dir and uses_pipeline(args):
        bubble = plugin.write_trace(args.trace_dir)
        log(f"schedule trace written to {args.trace_dir}: {bubble}")


def finish(args, booster, plugin, model, tokenizer, losses: List[float], started: float, prompt: str) -> None:
    """Report first/last loss, write the trace, save the checkpoint (with the tokenizer), generate on rank 0."""
    write_trace(args, plugin)
    k = min(5, len(losses))
    log(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f} (mean of first {k}: {sum(losses[:k]) / k:.4f}, "
        f"last {k}: {sum(losses[-k:]) / k:.4f}); {len(losses)} steps in {time.perf_counter() - started:.1f}s")
    if save_checkpoint(booster, model, args.out):
        if is_main():
            tokenizer.save_pretrained(args.out)
        dist.barrier(group=world_group())
        generate_from_checkpoint(args.out, prompt)
    dist.barrier(group=world_group())
    dist.destroy_process_group()


def pretrain(args, booster, plugin, started: float, name: str, build_model, prompt: str) -> None:
    """Pre-train a causal LM from scratch on lm_datasets: build_model(tokenizer, args) returns the HF model;
    logs its size, trains args.steps steps with validation before and after, then finish()es."""
    tokenizer, train_set, val_set = lm_datasets(args.seq_len)
    model = build_model(tokenizer, args)
    log(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}, "
        f"{len(train_set)} training blocks of {args.seq_len} tokens")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    lr_scheduler = warmup_cosine(optimizer, args.steps)
    criterion = lambda outputs, batch: outputs.loss  # noqa: E731 (the model shifts the labels itself)
    train_loader = plugin.prepare_dataloader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                             seed=args.seed)
    val_loader = plugin.prepare_dataloader(val_set, batch_size=args.batch_size, drop_last=True)

    model, optimizer, criterion, train_loader, lr_scheduler = booster.boost(model, optimizer, criterion,
                                                                            train_loader, lr_scheduler)
    log(f"validation loss before: {evaluate_loss(booster, plugin, args, model, criterion, val_loader):.4f}")
    losses = train(booster, plugin, args, model, optimizer, criterion, train_loader, lr_scheduler)
    log(f"validation loss after:  {evaluate_loss(booster, plugin, args, model, criterion, val_loader):.4f}")
    finish(args, booster, plugin, model, tokenizer, losses, started, prompt=prompt)
