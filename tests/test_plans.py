"""Models without a hand-written policy train exactly through the policy derived from their transformers plans:
a handful that exercise different features, under tp, pp and tp x pp, against the unsharded model."""
import pytest
import torch.distributed as dist
import transformers

from booster_plugin import Booster, HybridParallelPlugin
from shardformer.check.tiny import tiny_config
from shardformer.policies import PlanRefused, get_autopolicy
from tests import model_utils as mu
from tests.dist_utils import run_distributed

# family -> what it exercises
FAMILIES = {
    "Qwen3": "per-head q/k norms (replicated_with_grad_allreduce)",
    "Gemma": "embedding scaled inside its module, tied LM head",
    "Olmo2": "q/k norms over the whole projection (colwise_gather_output + rowwise_split_input)",
    "Granite": "embedding multiplier in the model's forward, residual/attention/logit multipliers",
    "Phi": "partial rotary, biases, embedding dropout entry module, final_layernorm exit",
    "Cohere": "parallel attention/MLP block, logit scale, tied head",
    "Gemma2": "sliding/full layer types per layer, soft-capping",
}
OVERRIDES = {"Granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3,
                             logits_scaling=2.0)}
for _family in FAMILIES:
    mu.MODELS[f"{_family.lower()}_lm"] = (
        lambda n=4, f=_family: getattr(transformers, f"{f}ForCausalLM")(
            tiny_config(getattr(transformers, f"{f}Config"), num_hidden_layers=n, **OVERRIDES.get(f, {}))))
KINDS = [f"{f.lower()}_lm" for f in FAMILIES]


def _four_ranks(kinds):
    for kind in kinds:
        mu.check_training(kind, steps=1, tp_size=2)  # dp 2
        mu.check_training(kind, steps=1, pp_size=2, num_microbatches=2)  # dp 2
        mu.check_training(kind, tp_size=2, pp_size=2, num_microbatches=2)


@pytest.mark.parametrize("kinds", [KINDS])
def test_derived_policies_train_exactly(kinds):
    run_distributed(4, _four_ranks, kinds)
