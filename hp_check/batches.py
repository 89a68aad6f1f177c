"""A training batch for a model's head, by its class name and config: token ids (a right-padded sample), pixel values
(image models) or log-mel features (speech encoders), and the labels its own loss reads. Inputs a model requires that
are not built here are named by `missing_inputs` (a check reports the model untested rather than faking them)."""
from __future__ import annotations

import inspect
from typing import List, Optional

import torch
from torch import nn

from shardformer.image_batches import has_image_layout, image_batch, vlm_batch

from .tiny import VOCAB

SEQ, CHOICES = 8, 3  # tokens per sample; options of a multiple-choice head

_LM = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration", "ForPreTraining")
_PER_SAMPLE = ("ForSequenceClassification", "ForNextSentencePrediction", "ForImageClassification",
               "ForAudioClassification")


def batch(size: int, seed: int, model: Optional[nn.Module] = None) -> dict:
    """Inputs and labels for the model's head (a causal LM's when no model is given); a base model gets none."""
    g = torch.Generator().manual_seed(seed)
    head = type(model).__name__ if model is not None else "ForCausalLM"
    config = getattr(model, "config", None)
    params = _forward_params(model)
    if params is not None and "pixel_values" in params:  # images alone (ViT) or text with images (a VLM)
        if "input_ids" not in params:
            return image_batch(model, size, g)
        if has_image_layout(config):  # (else no images: missing_inputs names pixel_values if the forward needs them)
            return vlm_batch(model, size, seed)
    choices = head.endswith(("ForMultipleChoice", "DoubleHeadsModel"))
    data = _inputs(size * CHOICES if choices else size, g, config, params)
    ids, mask = data.get("input_ids"), data.get("attention_mask")
    labels = getattr(config, "num_labels", 2)
    pick = lambda high, shape: torch.randint(0, high, shape, generator=g)  # noqa: E731
    if head.endswith(_PER_SAMPLE):
        data["labels"] = pick(2 if head.endswith("ForNextSentencePrediction") else labels, (size,))
    elif head.endswith("ForTokenClassification"):
        data["labels"] = pick(labels, (size, SEQ)).masked_fill(mask == 0, -100)
    elif head.endswith("ForQuestionAnswering"):
        data["start_positions"] = pick(SEQ - 3, (size,))
        data["end_positions"] = pick(SEQ - 3, (size,))
    elif head.endswith("ForMultipleChoice"):  # (batch, choices, seq)
        data = {k: v.view(size, CHOICES, SEQ) for k, v in data.items()}
        data["labels"] = pick(CHOICES, (size,))
    elif head.endswith("DoubleHeadsModel"):  # an LM loss over every choice and a choice at mc_token_ids
        data = {k: v.view(size, CHOICES, SEQ) for k, v in data.items()}
        data["labels"] = data["input_ids"].masked_fill(data["attention_mask"] == 0, -100)
        data["mc_token_ids"] = pick(SEQ - 3, (size, CHOICES))
        data["mc_labels"] = pick(CHOICES, (size,))
    elif head.endswith(_LM) and ids is not None:
        data["labels"] = ids.masked_fill(mask == 0, -100)
    elif ids is None and params is not None and "decoder_input_ids" in params:  # a speech encoder-decoder
        tokens = torch.randint(3, VOCAB, (size, SEQ), generator=g)
        data["labels" if head.endswith(_LM) else "decoder_input_ids"] = tokens
    if params is not None and "decoder_input_ids" in params and ids is not None and "labels" not in data and \
            not head.endswith(("ForQuestionAnswering", "ForSequenceClassification")):  # an encoder-decoder's base
        data["decoder_input_ids"] = ids
    if head.endswith("ForPreTraining") and "next_sentence_label" in params:
        data["next_sentence_label"] = pick(2, (size,))
    return data


def _inputs(rows: int, g: torch.Generator, config, params) -> dict:
    """Token ids and mask when the forward reads them (one end-of-sequence token per row, its last real one, for an
    encoder-decoder: its classifiers read the decoder's state there), else log-mel features."""
    if params is None or "input_ids" in params:
        ids = torch.randint(3, VOCAB, (rows, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0
        ids[0, -3:] = 0
        if getattr(config, "is_encoder_decoder", False) and isinstance(getattr(config, "eos_token_id", None), int):
            ids[torch.arange(rows), mask.sum(1) - 1] = config.eos_token_id
        return {"input_ids": ids, "attention_mask": mask}
    if "input_features" in params and isinstance(getattr(config, "num_mel_bins", None), int):
        return {"input_features": _features(rows, g, config)}
    return {}


def _features(rows: int, g: torch.Generator, config) -> torch.Tensor:
    """Log-mel features (rows, mel bins, frames): a speech encoder's convolutions halve the frames to its positions."""
    return torch.randn((rows, config.num_mel_bins, 2 * config.max_source_positions), generator=g)


def _forward_params(model: Optional[nn.Module]):
    return None if model is None else inspect.signature(model.forward).parameters


def missing_inputs(model: nn.Module, data: dict) -> List[str]:
    """The forward's required arguments (no default) that `data` lacks."""
    return [name for name, p in _forward_params(model).items()
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and name not in data]
