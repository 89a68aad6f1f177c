"""Pick the policy of a transformers model by its class name."""
from __future__ import annotations

from typing import Dict, Type

from torch import nn

from .base import Policy
from .bart import BartPolicy
from .bert import BertPolicy
from .gpt2 import GPT2Policy
from .llama import LlamaPolicy, MistralPolicy, Qwen2Policy
from .t5 import T5Policy

_FAMILIES: Dict[Type[Policy], tuple] = {
    GPT2Policy: ("GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPT2ForTokenClassification"),
    LlamaPolicy: ("LlamaModel", "LlamaForCausalLM", "LlamaForSequenceClassification"),
    MistralPolicy: ("MistralModel", "MistralForCausalLM", "MistralForSequenceClassification"),
    Qwen2Policy: ("Qwen2Model", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    T5Policy: ("T5ForConditionalGeneration", "T5Model"),
    BartPolicy: ("BartForConditionalGeneration", "BartModel"),
    BertPolicy: ("BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification"),
}
SUPPORTED_MODELS: Dict[str, Type[Policy]] = {name: policy for policy, names in _FAMILIES.items() for name in names}


def get_autopolicy(model: nn.Module) -> Policy:
    """A fresh policy for `model`; an unsupported model gets an error naming what is supported."""
    name = type(model).__name__
    if name not in SUPPORTED_MODELS:
        raise NotImplementedError(
            f"No sharding policy for {name}. Supported models: {', '.join(sorted(SUPPORTED_MODELS))}. "
            f"For another model, subclass shardformer.Policy (layers, entry, exit, tp_plan) and pass "
            f"HybridParallelPlugin(custom_policy=YourPolicy()).")
    return SUPPORTED_MODELS[name]()
