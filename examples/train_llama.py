"""Pre-train a small Llama from scratch on Python's own documentation, with tensor x pipeline x data parallel.

    torchrun --nproc_per_node=2 examples/train_llama.py                      # default layout: pp=2
    torchrun --nproc_per_node=1 examples/train_llama.py --tp 1 --pp 1        # one process
    torchrun --nproc_per_node=8 examples/train_llama.py --tp 2 --pp 2 --precision bf16   # dp=2
"""
import time

from transformers import LlamaConfig, LlamaForCausalLM

from common import get_parser, pretrain, setup


def build_model(tokenizer, args):
    """The model to pre-train, sized by --layers/--hidden."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max(256, args.seq_len), tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = get_parser(__doc__.splitlines()[0], out="out/llama")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    started = time.perf_counter()
    booster, plugin = setup(args)
    pretrain(args, booster, plugin, started, "Llama", build_model, prompt="A class definition defines")


if __name__ == "__main__":
    main()
