"""What transformers 5.24 declares about a model, on older transformers releases (down to 5.17, the lowest
setup.py allows), so that a model is split and checked alike on every supported release: the functions return what
5.24 gives and are no-ops there (tests/test_inferred_plans.py, tests/test_plans.py, tests/test_parallelize.py and the
multimodal and tensor-parallel tests fail on 5.17 without them).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from torch import nn

from ..tensor.lora_sharding import native_module

# the classes whose `_tp_plan = {"lm_head": "colwise_gather_output"}` transformers 5.24 declares and 5.17 does not
# (vision-language and some speech models; without it a tied LM head stays whole while its embedding is split)
HEAD_PLAN_CLASSES = frozenset({
    "AriaForConditionalGeneration", "AyaVisionForConditionalGeneration", "CodeGenForCausalLM",
    "Cohere2VisionForConditionalGeneration", "CohereCompassForConditionalGeneration",
    "Cosmos3EdgeForConditionalGeneration", "Cosmos3OmniForConditionalGeneration",
    "DeepseekOcr2ForConditionalGeneration", "DeepseekVLForConditionalGeneration",
    "DeepseekVLHybridForConditionalGeneration", "DiffusionGemmaForBlockDiffusion", "Emu3ForConditionalGeneration",
    "Ernie4_5_VLMoeForConditionalGeneration", "Exaone4_5_ForConditionalGeneration",
    "FastVlmForConditionalGeneration", "FunAsrNanoForConditionalGeneration", "GPTJForCausalLM",
    "Gemma3ForConditionalGeneration", "Gemma3nForConditionalGeneration", "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForConditionalGeneration", "Glm46VForConditionalGeneration", "Glm4vForConditionalGeneration",
    "Glm4vMoeForConditionalGeneration", "Glm5NextForConditionalGeneration", "GlmAsrForConditionalGeneration",
    "GlmImageForConditionalGeneration", "GlmOcrForConditionalGeneration", "GotOcr2ForConditionalGeneration",
    "Granite4VisionForConditionalGeneration", "GraniteSpeechForConditionalGeneration",
    "GraniteSpeechPlusForConditionalGeneration", "Idefics2ForConditionalGeneration",
    "Idefics3ForConditionalGeneration", "InternVLForConditionalGeneration", "JanusForConditionalGeneration",
    "Kimi_K25ForConditionalGeneration", "Lfm2VlForConditionalGeneration", "LightOnOcrForConditionalGeneration",
    "Llama4ForConditionalGeneration", "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
    "LlavaNextVideoForConditionalGeneration", "LlavaOnevisionForConditionalGeneration",
    "MiniCPMV4_6ForConditionalGeneration", "MiniMaxM3SparseForConditionalGeneration",
    "Mistral3ForConditionalGeneration", "NemotronForCausalLM", "NeoMMEForMaskedLM", "Ovis2ForConditionalGeneration",
    "PPFormulaNetForConditionalGeneration", "PaddleOCRVLForConditionalGeneration",
    "PaliGemmaForConditionalGeneration", "PerceptionLMForConditionalGeneration",
    "QianfanOCRForConditionalGeneration", "Qwen2VLForConditionalGeneration",
    "Qwen2_5OmniThinkerForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
    "Qwen3ASRForConditionalGeneration", "Qwen3OmniMoeThinkerForConditionalGeneration",
    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
    "SmolVLMForConditionalGeneration", "Step3p7ForConditionalGeneration", "VideoLlama3ForConditionalGeneration",
    "VideoLlavaForConditionalGeneration", "VipLlavaForConditionalGeneration",
    "VoxtralRealtimeForConditionalGeneration"
})


def declared_plans(model: nn.Module) -> Tuple[Dict, Dict]:
    """The model's own (`_pp_plan`, `_tp_plan`), completed as transformers 5.24 declares them, so that a model is
    split alike on every supported release (a no-op on 5.24):
    - the LM head column-split (`lm_head`: colwise_gather_output) on the classes of HEAD_PLAN_CLASSES;
    - the input embedding split over the vocabulary for every base model that has a tp plan and an `embed_tokens`
      nn.Embedding (5.17 declares it only where the word embeddings are tied). As in transformers, a base model's
      entries reach the top model's plan only through a chain of PreTrainedModels."""
    from transformers import PreTrainedModel
    pp = dict(getattr(model, "_pp_plan", None) or {})
    tp = dict(getattr(model, "_tp_plan", None) or {})

    def walk(module: nn.Module, prefix: str):
        yield prefix, module
        for name, child in module.named_children():
            if isinstance(child, PreTrainedModel) and getattr(child, "_tp_plan", None):
                yield from walk(child, f"{prefix}{name}.")

    if not tp:
        return pp, tp
    if ("lm_head" not in tp and isinstance(getattr(model, "lm_head", None), nn.Module)
            and any(c.__name__ in HEAD_PLAN_CLASSES for c in type(model).__mro__)):
        tp = {"lm_head": "colwise_gather_output", **tp}
    for prefix, module in list(walk(model, "")):
        key, embedding = prefix + "embed_tokens", getattr(module, "embed_tokens", None)
        # (the embedding itself where LoRA wraps it, as it was when transformers built the plan)
        if (getattr(module, "base_model", None) is module and getattr(module, "_tp_plan", None) and key not in tp
                and isinstance(embedding, nn.Module) and isinstance(native_module(embedding), nn.Embedding)):
            items = list(tp.items())
            at = next((i for i, (k, _) in enumerate(items) if k.startswith(prefix)), len(items))  # as transformers
            tp = dict(items[:at] + [(key, "embedding_rowwise")] + items[at:])
    return pp, tp


def kv_sharing_modes(config) -> List[Optional[str]]:
    """config.kv_sharing_modes (None / "store" / "reuse" per layer), or, on a transformers release whose configs do
    not have it yet (5.17: Gemma 3n, Gemma 4), the same modes from config.num_kv_shared_layers as later releases
    compute them: the last `num_kv_shared_layers` layers reuse, and the last earlier layer of each layer type stores,
    which is how those releases' models share keys/values. ValueError where a shared layer type has no producer."""
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is not None:
        return list(modes)
    shared, total = getattr(config, "num_kv_shared_layers", None), getattr(config, "num_hidden_layers", None)
    types = list(getattr(config, "layer_types", None) or ())
    if not (isinstance(shared, int) and isinstance(total, int) and 0 < shared and types):
        return []
    if shared >= total:
        return ["reuse"] * total
    first = total - shared
    modes = [None] * first + ["reuse"] * shared
    before = types[:first]
    if set(before) != set(types):
        raise ValueError("the set of layer types producing a cache is different than the set using them")
    for kind in set(types):
        modes[first - 1 - before[::-1].index(kind)] = "store"
    return modes
