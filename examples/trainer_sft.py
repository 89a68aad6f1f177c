"""Supervised fine-tuning of a tiny chat model with TRL's SFTTrainer on tensor x pipeline x data parallel
(HybridParallelSFTTrainer: the mixin before TRL's SFTTrainer).

A small Llama learns to answer the user's "Explain Python's `for`." with the reference documentation of that topic
(Python's own pydoc topics, offline), in a chat template whose assistant turns are marked (`{% generation %}`):
SFTTrainer's assistant-only loss counts the answer's tokens only, so Trainer's token-weighted loss over the
accumulation window and the replicas matters.

    torchrun --nproc_per_node=4 examples/trainer_sft.py                  # tp=2 x pp=2
    torchrun --nproc_per_node=2 examples/trainer_sft.py --tp 1 --pp 2    # pp=2
    torchrun --nproc_per_node=4 examples/trainer_sft.py --tp 1 --pp 2 --zero 1   # pp=2 x dp=2, ZeRO-1
"""
import argparse
import os

import torch
import torch.distributed as dist
import transformers
from datasets import Dataset
from pydoc_data.topics import topics
from transformers import LlamaConfig, LlamaForCausalLM
from trl import SFTConfig

from booster_plugin import HybridParallelPlugin, HybridParallelSFTTrainer, world_group
from common import default_layout, generate_from_checkpoint, init_distributed, log
from data import EOS, shared_tokenizer, unwrap_lines

# the user's turn, then the assistant's, marked for SFTConfig(assistant_only_loss=True)
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}\n{% else %}{% generation %}"
                 "{{ m['content'] }}" + EOS + "{% endgeneration %}{% endif %}{% endfor %}")


def conversations(names) -> Dataset:
    """One conversation per topic: "Explain Python's `topic`." -> the topic's documentation."""
    return Dataset.from_list([{"messages": [{"role": "user", "content": f"Explain Python's `{name}`."},
                                            {"role": "assistant", "content": unwrap_lines(topics[name])}]}
                              for name in names])


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: by world size)")
    p.add_argument("--pp", type=int, default=None, help="pipeline parallel size (default: by world size)")
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage over data parallel")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="per data-parallel replica and accumulation step")
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--out", default="out/trainer_sft")
    return p.parse_args()


def main() -> None:
    args = parse()
    init_distributed()
    if dist.get_rank() != 0:
        transformers.logging.set_verbosity_error()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    tp, pp = (args.tp or 1, args.pp or 1) if args.tp or args.pp else default_layout(dist.get_world_size())
    names = sorted(topics)
    tokenizer = shared_tokenizer([unwrap_lines(topics[n]) for n in names])
    tokenizer.chat_template = CHAT_TEMPLATE
    train_set = conversations([n for i, n in enumerate(names) if i % 10])
    val_set = conversations([n for i, n in enumerate(names) if i % 10 == 0])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    training = SFTConfig(
        args.out, per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation, max_steps=args.steps, learning_rate=2e-3, warmup_steps=5,
        weight_decay=0.01, max_grad_norm=1.0, logging_steps=10, save_strategy="no", report_to="none",
        dataloader_drop_last=True, use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
        assistant_only_loss=True, max_length=args.seq_len,
        pad_to_multiple_of=args.seq_len,  # every batch one length: pp stacks an accumulation window's batches
        gradient_checkpointing=False, bf16=False)  # on in TRL's defaults: the plugin's own options instead
    trainer = HybridParallelSFTTrainer(model=model, args=training, train_dataset=train_set, eval_dataset=val_set,
                                       processing_class=tokenizer,
                                       plugin=HybridParallelPlugin(tp_size=tp, pp_size=pp, zero_stage=args.zero))
    log(f"tp={tp} pp={pp} dp={trainer.plugin.dp_size}: {len(train_set)} questions, validation {len(val_set)}")
    log(f"validation loss before: {trainer.evaluate()['eval_loss']:.4f}")
    trainer.train()
    log(f"validation loss after: {trainer.evaluate()['eval_loss']:.4f}")
    final = os.path.join(args.out, "final")
    trainer.save_model(final)  # a Hugging Face folder with the tokenizer: plain transformers loads it
    dist.barrier(group=world_group())
    generate_from_checkpoint(final, "Explain Python's `for`.\n")  # the chat template's user turn
    dist.barrier(group=world_group())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
