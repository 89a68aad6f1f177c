"""Pre-train a small Llama from scratch on Python's own documentation, with tensor x pipeline x data parallel.

    torchrun --nproc_per_node=2 examples/train_llama.py                      # default layout: pp=2
    torchrun --nproc_per_node=1 examples/train_llama.py --tp 1 --pp 1        # one process
    torchrun --nproc_per_node=8 examples/train_llama.py --tp 2 --pp 2 --precision bf16   # dp=2
"""
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common import evaluate_loss, finish, get_parser, log, setup, train, warmup_cosine
from data import lm_datasets


def main() -> None:
    parser = get_parser(__doc__.splitlines()[0], out="out/llama")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    started = time.perf_counter()
    booster, plugin = setup(args)

    tokenizer, train_set, val_set = lm_datasets(args.seq_len)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max(256, args.seq_len), tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    log(f"Llama: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}, "
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
    finish(args, booster, plugin, model, tokenizer, losses, started, prompt="A class definition defines")


if __name__ == "__main__":
    main()
