"""Segment Anything (SamModel), tensor parallel, as ColossalAI's SAM policy splits it. The vision encoder's fused
`qkv` output is [q | k | v], each (heads, head_dim) (its forward reshapes it (..., 3, heads, head_dim)): a column
split of each third gives a rank whole heads of q, k and v; `proj` and the MLP's `lin2` by rows. The relative
position tables (`rel_pos_h`, `rel_pos_w`: one row of head_dim per distance, shared by every head) stay whole: each
rank's gradient covers its heads only and is summed over tp. The mask decoder's attentions (q/k/v by columns,
out_proj by rows, each reshaping with num_attention_heads) and MLPs split alike; the prompt encoder, the neck, the
upscaling and the output heads are replicated. Pipeline parallelism is refused (layers_per_stage says why)."""
from typing import List

from .base import Colwise, GradAllReduce, Policy, Rowwise
from .from_transformers import PlanRefused

VISION = "vision_encoder.layers.*."
DECODER = "mask_decoder.transformer."
DECODER_ATTENTIONS = tuple(DECODER + "layers.*." + a for a in ("self_attn", "cross_attn_token_to_image",
                                                                 "cross_attn_image_to_token")) \
    + (DECODER + "final_attn_token_to_image",)   # SamAttention


class SamPolicy(Policy):
    layers = "vision_encoder.layers"
    tp_plan = {VISION + "attn.qkv": Colwise(n_fused=3), VISION + "attn.proj": Rowwise(),
               VISION + "attn.rel_pos_h": GradAllReduce(), VISION + "attn.rel_pos_w": GradAllReduce(),
               VISION + "mlp.lin1": Colwise(), VISION + "mlp.lin2": Rowwise(),
               DECODER + "layers.*.mlp.lin1": Colwise(), DECODER + "layers.*.mlp.lin2": Rowwise(),
               **{f"{a}.{p}": Colwise() for a in DECODER_ATTENTIONS for p in ("q_proj", "k_proj", "v_proj")},
               **{f"{a}.out_proj": Rowwise() for a in DECODER_ATTENTIONS}}
    tp_attributes = {VISION + "attn": ("num_attention_heads",),
                     **{a: ("num_attention_heads",) for a in DECODER_ATTENTIONS}}
    tp_divisible = ("num_attention_heads", "mlp_dim")
    local_rng_modules = (VISION + "attn",)   # (eager) dropout of split heads' attention probabilities: per rank

    def check_tp(self, config, tp_size: int) -> None:
        super().check_tp(config.vision_config, tp_size)
        super().check_tp(config.mask_decoder_config, tp_size)

    def check_split(self, split: List[int]) -> None:
        if self.stage_manager.num_stages > 1:
            raise PlanRefused(f"{type(self.model).__name__}: its forward runs the whole vision encoder from "
                              f"pixel_values (a later stage gets no image embeddings to start from) and the encoder "
                              f"adds its raw pos_embed parameter after the patch embedding, which no stage's "
                              f"stand-in can leave out. Use pp_size=1 (tensor and data parallel).")
        super().check_split(split)
