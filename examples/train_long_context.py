"""Train a tiny Llama on packed long rows with ring attention: the sequence split over a sequence-parallel group.

    torchrun --nproc_per_node=2 examples/train_long_context.py                          # sp=2, ring_attn
    torchrun --nproc_per_node=2 examples/train_long_context.py --mode all_to_all        # sp=2, Ulysses
    torchrun --nproc_per_node=4 examples/train_long_context.py --sp 2 --tp 2            # sp=2 x tp=2
    torchrun --nproc_per_node=4 examples/train_long_context.py --sp 2 --pp 2            # sp=2 x pp=2

Synthetic documents (a random first token, then a fixed random successor of each token: the loss falls within a few
steps) are packed into rows of --seq-len
tokens with booster_plugin.packing.pack_documents: whole documents per row, position_ids restarting at 0 at each
document, each document's first label masked, a free tail padded as a document of its own. The model has
use_cache=False, so transformers builds a mask that keeps attention inside each document, and ring attention reads
that mask: every rank computes exactly what one process would. Each rank of the sp group holds two of the 2*sp
chunks of every row (zigzag), so --seq-len must be a multiple of 2*sp (and of tp with --tp).
"""
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from booster_plugin import Booster, HybridParallelPlugin, world_group
from booster_plugin.packing import pack_documents
from common import dp_mean, get_parser, init_distributed, log, seed_all, train_step

VOCAB = 128


def documents(seed: int, min_len: int, max_len: int):
    """An endless stream of synthetic documents: a random first token, then each token the successor of the previous
    one in a fixed random permutation of the ids 1..VOCAB-1 (the same for every document: learnable in a few steps;
    the first token of each document is unpredictable, and pack_documents masks its label)."""
    g = torch.Generator().manual_seed(seed)
    successor = 1 + torch.randperm(VOCAB - 1, generator=torch.Generator().manual_seed(0))  # id i -> successor[i - 1]
    while True:
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        doc = [int(torch.randint(1, VOCAB, (1,), generator=g))]
        while len(doc) < length:
            doc.append(int(successor[doc[-1] - 1]))
        yield doc


def build_model(args) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len, tie_word_embeddings=False, pad_token_id=0,
                         use_cache=False,  # packed rows: transformers keeps attention inside each document
                         attn_implementation="sdpa")  # ring attention reads sdpa's (or eager's) mask
    return LlamaForCausalLM(config)


def main() -> None:
    parser = get_parser(__doc__.splitlines()[0], steps=12, batch_size=2, seq_len=2048, lr=3e-3,
                        out="out/long_context")
    parser.add_argument("--sp", type=int, default=2, help="sequence-parallel group size")
    parser.add_argument("--mode", choices=("ring_attn", "all_to_all"), default="ring_attn")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--min-doc", type=int, default=64, help="shortest synthetic document (tokens)")
    parser.add_argument("--max-doc", type=int, default=1024, help="longest synthetic document (tokens)")
    args = parser.parse_args()
    init_distributed()
    torch.set_num_threads(1)  # one thread per rank: the ranks share the CPU cores
    seed_all(args.seed)
    args.tp, args.pp = args.tp or 1, args.pp or 1
    if args.pp > 1 and args.microbatches is None:
        args.microbatches = 2
    plugin = HybridParallelPlugin(tp_size=args.tp, pp_size=args.pp, sp_size=args.sp, enable_sequence_parallelism=True,
                                  sequence_parallelism_mode=args.mode, num_microbatches=args.microbatches,
                                  precision=args.precision, max_norm=args.max_norm, seed=args.seed)
    log(f"world {dist.get_world_size()}: sp={args.sp} ({args.mode}) tp={args.tp} pp={args.pp} dp={plugin.dp_size}; "
        f"rows of {args.seq_len} tokens, each rank's layers see {args.seq_len // args.sp}")
    booster = Booster(plugin=plugin)
    model = build_model(args)
    log(f"Llama: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {args.layers} layers, "
        f"hidden {args.hidden}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    criterion = lambda outputs, batch: outputs.loss  # noqa: E731  (HF's causal LM loss on the packed labels)
    model, optimizer, criterion, *_ = booster.boost(model, optimizer, criterion)
    model.train()

    # every replica packs the same global batch and takes its rows; the sp (and tp, pp) ranks of a replica share them
    global_rows = args.batch_size * plugin.dp_size
    batches = pack_documents(documents(args.seed, args.min_doc, args.max_doc), args.seq_len, pad_token_id=0,
                             rows_per_batch=global_rows)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        batch = next(batches)
        docs = int((batch["position_ids"] == 0).sum())
        rows = slice(plugin.dp_rank * args.batch_size, (plugin.dp_rank + 1) * args.batch_size)
        batch = {k: v[rows].to(plugin.device) for k, v in batch.items()}
        t0 = time.perf_counter()
        loss = train_step(booster, args, model, optimizer, criterion, batch)
        losses.append(dp_mean(loss, plugin))
        tokens = global_rows * args.seq_len
        log(f"step {step + 1:3d}/{args.steps}  loss {losses[-1]:.4f}  {docs} documents in {global_rows} rows  "
            f"{tokens / (time.perf_counter() - t0):.0f} tokens/s")
    k = min(3, len(losses))
    log(f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f} (mean of last {k}: {sum(losses[-k:]) / k:.4f}); "
        f"{time.perf_counter() - start:.0f} s")
    dist.barrier(group=world_group())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
