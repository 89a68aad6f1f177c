"""Pick the policy of a transformers model: a hand-written one for the families without plans (GPT-2, BERT, T5,
BART), else one derived from the plans transformers declares; the path taken is logged on rank 0."""
from __future__ import annotations

import logging
from typing import Dict, Type

import torch.distributed as dist
from torch import nn

from .base import Policy
from .bart import BartPolicy
from .bert import BertPolicy
from .from_transformers import PlanRefused, TransformersPlanPolicy
from .gpt2 import GPT2Policy
from .t5 import T5Policy

logger = logging.getLogger("shardformer")

_FAMILIES: Dict[Type[Policy], tuple] = {
    GPT2Policy: ("GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPT2ForTokenClassification"),
    T5Policy: ("T5ForConditionalGeneration", "T5Model"),
    BartPolicy: ("BartForConditionalGeneration", "BartModel"),
    BertPolicy: ("BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification"),
}
SUPPORTED_MODELS: Dict[str, Type[Policy]] = {name: policy for policy, names in _FAMILIES.items() for name in names}


def _log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(message)


def get_autopolicy(model: nn.Module) -> Policy:
    """A fresh policy for `model`; a model that cannot be parallelized gets an error saying why and what to do."""
    name = type(model).__name__
    if name in SUPPORTED_MODELS:
        _log(f"{name}: built-in policy {SUPPORTED_MODELS[name].__name__}.")
        return SUPPORTED_MODELS[name]()
    try:
        policy = TransformersPlanPolicy(model)
    except PlanRefused as refused:
        _log(f"{name}: refused: {refused}")
        raise PlanRefused(
            f"No sharding policy for {name}: {refused} Supported models: {', '.join(sorted(SUPPORTED_MODELS))} and "
            f"those whose config declares base_model_tp_plan and base_model_pp_plan (derived policy). "
            f"For another model, subclass shardformer.Policy (layers, entry, exit, tp_plan) and pass "
            f"HybridParallelPlugin(custom_policy=YourPolicy()).") from None
    _log(f"{name}: policy derived from its transformers plans (layers '{policy.layers}', "
         f"{len(policy.tp_plan) + len(policy.head_tp_plan)} tp plan entries).")
    return policy
