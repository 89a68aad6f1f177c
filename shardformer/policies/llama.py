"""Llama-like decoders (Llama, Mistral, Qwen2): q/k/v/o and gate/up/down projections; rotary and masks stay the
model's own (computed in its forward from the real inputs on every stage)."""
from typing import Dict

from .base import INPUT, Colwise, Policy, Rowwise, VocabEmbedding, VocabHead


class LlamaPolicy(Policy):
    layers = "layers"
    entry = {"embed_tokens": INPUT}
    exit = ("norm",)
    tp_plan = {
        "embed_tokens": VocabEmbedding(),
        "layers.*.self_attn.q_proj": Colwise(),
        "layers.*.self_attn.k_proj": Colwise(),
        "layers.*.self_attn.v_proj": Colwise(),
        "layers.*.self_attn.o_proj": Rowwise(),
        "layers.*.mlp.gate_proj": Colwise(),
        "layers.*.mlp.up_proj": Colwise(),
        "layers.*.mlp.down_proj": Rowwise(),
    }
    head_tp_plan = {"lm_head": VocabHead()}
    tp_attributes = {}  # attention reshapes with -1 heads; nothing to divide
    tp_input_regions = ("layers.*.self_attn", "layers.*.mlp")  # q/k/v and gate/up share one input
    tp_divisible = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
    local_rng_modules = ("layers.*.self_attn",)


class MistralPolicy(LlamaPolicy):
    """Mistral: Llama's layout; its sliding-window masks come from its own forward."""


class Qwen2Policy(LlamaPolicy):
    """Qwen2: Llama's layout plus q/k/v biases (sharded with their columns)."""

    def stage_config_overrides(self, start: int, end: int) -> Dict[str, object]:
        # Qwen2Model picks each layer's mask by its position in the loop over the (stage-pruned) layer list.
        layer_types = getattr(self.model.config, "layer_types", None)
        return {"layer_types": layer_types[start:end]} if layer_types else {}
