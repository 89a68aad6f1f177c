"""BLIP-2 with an OPT language model (Blip2ForConditionalGeneration, Blip2Model: the same modules), tensor parallel: the language model split as
OPT's inferred plan splits it (q/k/v and fc1 by columns, out_proj and fc2 by rows, vocab-parallel embedding); the
vision encoder, Q-Former and projector replicated (their gradients are equal on the tp ranks: the merged
embeddings' gradient is the tp regions' summed one). The LM head's logits are gathered: BLIP-2 computes the loss
itself over the full vocabulary. Pipeline parallelism is refused: the model's forward runs its vision encoder and
Q-Former on every call (it takes no image features computed elsewhere), so a later stage cannot run it."""
from typing import List

from .base import Colwise, Policy, Rowwise, VocabEmbedding, VocabHead
from .from_transformers import PlanRefused

OPT = "language_model.model.decoder."


class Blip2OPTPolicy(Policy):
    layers = OPT + "layers"
    tp_plan = {OPT + "embed_tokens": VocabEmbedding(), OPT + "layers.*.self_attn.q_proj": Colwise(),
               OPT + "layers.*.self_attn.k_proj": Colwise(), OPT + "layers.*.self_attn.v_proj": Colwise(),
               OPT + "layers.*.self_attn.out_proj": Rowwise(), OPT + "layers.*.fc1": Colwise(),
               OPT + "layers.*.fc2": Rowwise(), "language_model.lm_head": VocabHead(gather_output=True)}
    tp_attributes = {OPT + "layers.*.self_attn": ("embed_dim", "num_heads")}   # OPT reshapes with num_heads
    tp_input_regions = (OPT + "layers.*.self_attn",)
    tp_divisible = ("num_attention_heads", "ffn_dim")

    def set_model(self, model) -> None:
        text = model.config.text_config
        if text.model_type != "opt":
            raise PlanRefused(f"{type(model).__name__} with a {text.model_type} language model: only BLIP-2 with an "
                              f"OPT language model has a policy (Blip2OPTPolicy); write one (custom_policy=...).")
        super().set_model(model)

    def check_tp(self, config, tp_size: int) -> None:
        super().check_tp(config.text_config, tp_size)

    def check_split(self, split: List[int]) -> None:
        if self.stage_manager.num_stages > 1:
            raise PlanRefused(f"{type(self.model).__name__}: its forward runs the vision encoder and Q-Former on "
                              f"every call, so no pipeline stage but the first can run it. Use pp_size=1 (tensor "
                              f"and data parallel).")
        super().check_split(split)
