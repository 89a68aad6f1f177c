"""A model without a built-in policy (OPT) is parallelized by a user-written Policy of a dozen declarative lines,
and trains exactly like the unsharded model under tp, pp and both."""
from shardformer.policies import Colwise, Policy, Rowwise, VocabEmbedding, VocabHead
from shardformer.policies.base import IDENTITY, INPUT, ZEROS
from tests import model_utils as mu
from tests.dist_utils import run_distributed


class OPTPolicy(Policy):
    layers = "decoder.layers"
    # positions are learned and added in the decoder's forward: zeros after stage 0; project_in already applied
    entry = {"decoder.embed_tokens": INPUT, "decoder.embed_positions": ZEROS, "decoder.project_in": IDENTITY}
    exit = ("decoder.final_layer_norm", "decoder.project_out")
    tp_plan = {
        "decoder.embed_tokens": VocabEmbedding(),
        "decoder.layers.*.self_attn.q_proj": Colwise(),
        "decoder.layers.*.self_attn.k_proj": Colwise(),
        "decoder.layers.*.self_attn.v_proj": Colwise(),
        "decoder.layers.*.self_attn.out_proj": Rowwise(),
        "decoder.layers.*.fc1": Colwise(),
        "decoder.layers.*.fc2": Rowwise(),
    }
    head_tp_plan = {"lm_head": VocabHead()}
    tp_attributes = {"decoder.layers.*.self_attn": ("num_heads",)}  # OPT reshapes with num_heads, not -1
    tp_input_regions = ("decoder.layers.*.self_attn",)
    tp_divisible = ("num_attention_heads", "ffn_dim")


def _four_ranks():
    mu.check_training("opt_lm", tp_size=2, custom_policy=OPTPolicy())  # dp=2
    mu.check_training("opt_lm", pp_size=4, num_microbatches=4, custom_policy=OPTPolicy())
    mu.check_training("opt_lm", tp_size=2, pp_size=2, num_microbatches=2, custom_policy=OPTPolicy())
    mu.check_evaluation("opt_lm", tp_size=2, pp_size=2, num_microbatches=2, custom_policy=OPTPolicy())


def test_custom_policy_for_opt():
    run_distributed(4, _four_ranks)
