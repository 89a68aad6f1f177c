"""GPT-2: fused Conv1D q/k/v (`c_attn`, weights stored (in, out)), learned positions, LM head tied to `wte`."""
from .base import IDENTITY, INPUT, ZEROS, Colwise, Policy, Rowwise, VocabEmbedding, VocabHead


class GPT2Policy(Policy):
    layers = "h"
    # GPT2Model adds `wpe` and applies `drop` even to received hidden states: zero / skip them after stage 0.
    entry = {"wte": INPUT, "wpe": ZEROS, "drop": IDENTITY}
    exit = ("ln_f",)
    tp_plan = {
        "wte": VocabEmbedding(),
        "h.*.attn.c_attn": Colwise(n_fused=3),
        "h.*.attn.c_proj": Rowwise(),
        "h.*.mlp.c_fc": Colwise(),
        "h.*.mlp.c_proj": Rowwise(),
    }
    head_tp_plan = {"lm_head": VocabHead()}
    # the fused output is split with `split_size`: each rank holds num_heads / tp heads
    tp_attributes = {"h.*.attn": ("num_heads", "split_size")}
    tp_divisible = ("n_head", "n_inner")
    local_rng_modules = ("h.*.attn",)
    shared_rng_modules = ("h.*.attn.resid_dropout",)
