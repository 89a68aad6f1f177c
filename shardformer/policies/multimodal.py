"""Vision-language models (LLaVA, Qwen2-VL / Qwen2.5-VL / Qwen3-VL, Gemma 3, Idefics3 / SmolVLM, Mistral3, ...):
the text decoder's policy is derived from transformers' plans as for any decoder (from_transformers.py); what the
plans leave out is taken from the model's structure, with no per-model code:
- The encoders: the base model's children with parameters that the plans do not name (a vision tower, a projector
  or connector) are entry modules, so the first stage holds them and runs them, in the model's own forward, which
  merges the image features into the embeddings; the other stages release them. They stay replicated under tp
  (their gradients are equal on the tp ranks: the merged embeddings' gradient is the tp regions' summed one).
- The inputs: the forward's `pixel_values*` keywords reach the first virtual stage only (the model's own forward
  skips its encoder without them); every other input (`input_ids`, `attention_mask`, `image_grid_thw`,
  `mm_token_type_ids`, `token_type_ids`, ...) reaches every stage, where the model computes from them what its
  layers need (masks, M-RoPE position ids), as the first stage does.
- A stage's slice of the text config's `layer_types` goes to the language model, whose loop reads it.
- Microbatches: inputs whose dim 0 counts images or patches, not samples (multimodal_batch.py).
"""
from __future__ import annotations

import inspect
import re
from typing import Dict, List, Optional, Tuple

from torch import nn

from ..multimodal_batch import attribute
from ..paths import base_prefix
from ..stage.forward import RELEASED
from ..tensor.styles import Colwise
from .from_transformers import PlanRefused, TransformersPlanPolicy
from .plan import per_layer

__all__ = ["MultimodalPolicy", "is_multimodal"]

FIRST_STAGE_INPUT_PREFIX = "pixel_values"  # the forward's keywords the encoders alone read
# text decoders whose config declares no plans (transformers 5.24) -> the text family whose layers they copy
BORROWED_PLANS = {"qwen3_vl": "qwen3"}
# families whose encoder also feeds the first decoder layers (a config list, one entry per layer fed): the model
# adds features to the outputs of the first n layers in its loop (Qwen3-VL's deepstack), after the layer returns, so
# the first stage, the one running the encoder, must hold n + 1 layers (its last layer's output leaves as it is)
ENCODER_FED_LAYERS = {"qwen3_vl": "vision_config.deepstack_visual_indexes"}
# arguments of the language model's forward that carry an encoder's output into its layers (deepstack features,
# cross-attention states): only families declared above may then be split by the pipeline
ENCODER_OUTPUT_ARGUMENT = re.compile(r"visual|vision|image|deepstack|cross_attention|encoder_hidden")


def is_multimodal(model: nn.Module) -> bool:
    """A transformers model taking images (and text) into one decoder: its class says so."""
    modalities = getattr(model, "input_modalities", ()) or ()
    modalities = (modalities,) if isinstance(modalities, str) else tuple(modalities)
    config = getattr(model, "config", None)
    return "image" in modalities and "text" in modalities and not getattr(config, "is_encoder_decoder", False)


class MultimodalPolicy(TransformersPlanPolicy):
    """The text decoder from the plans; the encoders on the first stage (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, _borrowed_plans(model))
        base = model.base_model
        named = {p.split(".")[0] for p in (self.layers, *self.entry, *self.exit)}
        # a composite model: its layers belong to a language model beside the encoders (a model whose base model
        # loops over the layers itself runs its encoders inside its entry modules: the plans' policy as is)
        composite = "." in self.layers
        self.encoders = tuple(n for n, m in base.named_children() if composite and n not in named
                              and next(m.parameters(), None) is not None)
        if self.encoders:
            self.entry = {**{n: RELEASED for n in self.encoders}, **self.entry}
            forward = inspect.signature(type(model).forward).parameters
            self.first_stage_inputs = tuple(k for k in forward if k.startswith(FIRST_STAGE_INPUT_PREFIX))
        text = self._text_config(model.config)  # the heads the plan splits are the text decoder's
        splits_heads = any(isinstance(s, Colwise) and not s.gather_output for s in self.tp_plan.values())
        self.tp_divisible = tuple(a for a in ("num_attention_heads", "num_key_value_heads")
                                  if splits_heads and isinstance(getattr(text, a, None), int))

    def _text_config(self, config):
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def check_tp(self, config, tp_size: int) -> None:
        """The text decoder's heads must split (the encoders stay whole)."""
        super().check_tp(self._text_config(config), tp_size)

    def tp_config(self):
        return self._text_config(self.model.config)

    def per_layer_config(self) -> Dict[str, Tuple[object, ...]]:
        """The language model's loop picks a layer's mask by its position among the held layers."""
        return per_layer(self._loop().config)

    def _loop(self) -> nn.Module:
        return self.model.get_submodule((self.base_prefix + self.layers).rpartition(".")[0])

    def check_split(self, split: List[int]) -> None:
        super().check_split(split)
        fed = ENCODER_FED_LAYERS.get(getattr(self.model.config, "model_type", None))
        taken = [a for a in inspect.signature(self._loop().forward).parameters if ENCODER_OUTPUT_ARGUMENT.search(a)]
        if taken and not fed and self.encoders and self.stage_manager.num_stages > 1:
            raise PlanRefused(f"{type(self.model).__name__}: its language model's forward takes {taken} from the "
                              f"encoder, which runs on the first pipeline stage only, so the layers of later stages "
                              f"would go without them. Use pp_size=1 (tensor and data parallel).")
        n = len(attribute(self.model.config, fed)) if fed else 0
        if n and self.stage_manager.num_stages > 1 and split[0] <= n:
            raise PlanRefused(f"{type(self.model).__name__}: its vision encoder's features are added to the outputs of "
                              f"the first {n} decoder layers (config.{fed}) in the model's loop, so the first stage "
                              f"(the one running the encoder) must hold them and one more layer; the pipeline split "
                              f"{split} gives it {split[0]}: give num_layers_per_stage whose first entry is at least "
                              f"{n + 1}.")


def _borrowed_plans(model: nn.Module) -> Optional[Tuple[Dict, Dict]]:
    """(pp plan, tp plan) for a text decoder that declares none, from the text family it copies (BORROWED_PLANS),
    under the path of the base model's child that holds the text config."""
    family = BORROWED_PLANS.get(getattr(model.config, "model_type", None))
    if family is None:
        return None
    from transformers import CONFIG_MAPPING
    source, text = CONFIG_MAPPING[family], model.config.get_text_config()
    path = next((n for n, m in model.base_model.named_children() if getattr(m, "config", None) is text), None)
    if path is None:
        return None
    prefix = base_prefix(model) + path + "."
    pp = {prefix + k: v for k, v in (source.base_model_pp_plan or {}).items()}
    tp = {**(getattr(model, "_tp_plan", None) or {}), **{prefix + k: v for k, v in source.base_model_tp_plan.items()}}
    return pp, tp
