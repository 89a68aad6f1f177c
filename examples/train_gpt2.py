"""Pre-train a small GPT-2 from scratch on Python's own documentation, with tensor x pipeline x data parallel.

    torchrun --nproc_per_node=2 examples/train_gpt2.py                       # default layout: pp=2
    torchrun --nproc_per_node=1 examples/train_gpt2.py --tp 1 --pp 1         # one process
    torchrun --nproc_per_node=4 examples/train_gpt2.py --tp 2 --pp 2 --precision bf16
"""
import time

from transformers import GPT2Config, GPT2LMHeadModel

from common import get_parser, pretrain, setup


def build_model(tokenizer, args):
    """The model to pre-train, sized by --layers/--hidden."""
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=max(256, args.seq_len), n_embd=args.hidden,
                        n_layer=args.layers, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    return GPT2LMHeadModel(config)


def main() -> None:
    parser = get_parser(__doc__.splitlines()[0], out="out/gpt2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    started = time.perf_counter()
    booster, plugin = setup(args)
    pretrain(args, booster, plugin, started, "GPT-2", build_model, prompt="The \"if\" statement is used for")


if __name__ == "__main__":
    main()
