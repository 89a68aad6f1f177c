"""Pick the policy of a transformers model: a hand-written one for the families without plans (GPT-2, BERT, T5,
BART, BLOOM, Falcon, Whisper, BLIP-2 with OPT, SAM), else one derived from the plans transformers declares, else
(no plan declared) one inferred from the model's structure and proven by one forward when sharding (inferred.py);
the path taken is logged on rank 0."""
from __future__ import annotations

import enum
import logging
from typing import Dict, NamedTuple, Type

import torch.distributed as dist
from torch import nn

from .base import Policy
from .bart import BartPolicy
from .bert import BertPolicy
from .blip2 import Blip2OPTPolicy
from .bloom import BloomPolicy
from .falcon import FalconPolicy
from .from_transformers import PlanRefused, TransformersPlanPolicy
from .gpt2 import GPT2Policy
from .inferred import infer_policy
from .multimodal import MultimodalPolicy, is_multimodal
from .sam import SamPolicy
from .t5 import T5EncoderPolicy, T5Policy
from .whisper import WhisperPolicy
from .whisper_audio_classification import WhisperForAudioClassificationPolicy

logger = logging.getLogger("shardformer")

_FAMILIES: Dict[Type[Policy], tuple] = {
    GPT2Policy: ("GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPT2ForTokenClassification"),
    T5Policy: ("T5ForConditionalGeneration", "T5Model"),
    T5EncoderPolicy: ("T5EncoderModel",),  # (T5ForTokenClassification: found by its base model's class)
    BartPolicy: ("BartForConditionalGeneration", "BartModel"),
    BertPolicy: ("BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification"),
    BloomPolicy: ("BloomModel",),    # (and every head of the family: found by the base model's class)
    FalconPolicy: ("FalconModel",),
    WhisperPolicy: ("WhisperForConditionalGeneration", "WhisperModel"),
    WhisperForAudioClassificationPolicy: ("WhisperForAudioClassification",),
    Blip2OPTPolicy: ("Blip2ForConditionalGeneration", "Blip2Model"),
    SamPolicy: ("SamModel",),
}
SUPPORTED_MODELS: Dict[str, Type[Policy]] = {name: policy for policy, names in _FAMILIES.items() for name in names}


def _log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(message)


def builtin_policy(model: nn.Module):
    """The hand-written policy class of `model`: by its class, or (any task head of the family:
    BertForQuestionAnswering, GPT2DoubleHeadsModel, BartForSequenceClassification, ...) by its base model's class,
    since policies are relative to the base model and the head (every top-level module outside it) is the last
    stage's; None if none."""
    policy = SUPPORTED_MODELS.get(type(model).__name__)
    base = getattr(model, "base_model", model)
    if policy is None and base is not model:
        policy = SUPPORTED_MODELS.get(type(base).__name__)
    return policy


class PlanSource(enum.Enum):
    """Where a model's policy came from."""
    HAND_WRITTEN = "hand-written"    # a built-in Policy subclass of the family
    TRANSFORMERS = "transformers"    # derived from the plans transformers declares (text decoder of a multimodal one)
    INFERRED = "inferred"            # inferred from the model's structure, proven by one forward when sharded


class PolicyChoice(NamedTuple):
    """The policy picked for a model and the path that picked it."""
    policy: Policy
    source: PlanSource

    def describe(self) -> str:
        """e.g. 'hand-written (BertPolicy)', 'transformers (TransformersPlanPolicy)'."""
        return f"{self.source.value} ({type(self.policy).__name__})"


def get_autopolicy(model: nn.Module) -> Policy:
    """A fresh policy for `model`; a model that cannot be parallelized gets an error saying why and what to do."""
    return choose_policy(model).policy


def choose_policy(model: nn.Module) -> PolicyChoice:
    """A fresh policy for `model` and its source (raises PlanRefused as get_autopolicy does)."""
    name = type(model).__name__
    builtin = builtin_policy(model)
    if builtin is not None:
        _log(f"{name}: built-in policy {builtin.__name__}.")
        return PolicyChoice(builtin(), PlanSource.HAND_WRITTEN)
    try:
        policy = (MultimodalPolicy if is_multimodal(model) else TransformersPlanPolicy)(model)
    except PlanRefused as refused:
        config = getattr(model, "config", None)
        if config is not None and not is_multimodal(model) and not getattr(config, "base_model_tp_plan", None):
            # no plan declared: one inferred from the structure
            try:
                policy = infer_policy(model)
            except PlanRefused as not_inferred:
                refused = PlanRefused(f"{refused} Nor can a plan be inferred from its structure: {not_inferred}")
            else:
                _log(f"{name}: no transformers plan; policy inferred from its structure (layers '{policy.layers}', "
                     f"{len(policy.tp_plan) + len(policy.head_tp_plan)} tp plan entries), proven when sharded.")
                return PolicyChoice(policy, PlanSource.INFERRED)
        _log(f"{name}: refused: {refused}")
        raise PlanRefused(
            f"No sharding policy for {name}: {refused} Supported models: {', '.join(sorted(SUPPORTED_MODELS))} "
            f"(with every task head around these base models) and those whose config declares base_model_tp_plan "
            f"and base_model_pp_plan (derived policy). "
            f"For another model, subclass shardformer.Policy (layers, entry, exit, tp_plan) and pass "
            f"HybridParallelPlugin(custom_policy=YourPolicy()).") from None
    _log(f"{name}: policy derived from its transformers plans (layers '{policy.layers}', "
         f"{len(policy.tp_plan) + len(policy.head_tp_plan)} tp plan entries).")
    return PolicyChoice(policy, PlanSource.TRANSFORMERS)
