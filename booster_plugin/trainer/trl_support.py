"""TRL's SFTTrainer and DPOTrainer under HybridParallelTrainerMixin. Imports nothing from TRL until a TRL trainer
is in use (then `trl` is imported already).

TRL's trainers compute their losses through a fused LM head that TRL patches onto the model: `model(..., labels=...,
fused_lm_head=True)` projects the backbone's hidden states through `lm_head.weight` itself and returns per-token
log-probabilities (`FusedCausalLMOutput`). On the plugin that weight is this rank's vocabulary shard and the hidden
states may be this rank's part of the sequence, so the call is answered here instead (`FusedHeadOnPlugin`): the
boosted model runs its own forward without labels (full sequence; under tp the training logits vocab-sharded, then
gathered with the gradient split back), and the per-token fields TRL reads are computed from those logits as TRL's
kernel defines them. Under pp the pipeline takes the model's own loss for SFTTrainer (its `nll` loss is exactly that,
token-weighted with `num_items_in_batch`); DPOTrainer's step computes DPO's loss in a criterion (dpo_pipeline.py).

DPOTrainer's reference model is boosted on the plugin's layout too (same plugin, no optimizer, eval mode).
Padding-free batches lose the flash-attention-only keys (`cu_seq_lens_*`, `max_length_*`, `seq_idx`): the plugin's
attention reads the documents from `position_ids`, as transformers' sdpa/eager masks do."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _trl_class(name: str) -> Optional[type]:
    """TRL's trainer class `name`, if TRL is imported (a TRL trainer instance implies it is)."""
    if "trl" not in sys.modules:
        return None
    import trl
    return getattr(trl, name, None)


def is_trl(trainer: object, name: str) -> bool:
    cls = _trl_class(name)
    return cls is not None and isinstance(trainer, cls)


def is_trl_trainer(trainer: object) -> bool:
    return is_trl(trainer, "SFTTrainer") or is_trl(trainer, "DPOTrainer")


def sft_loss_is_models_own(trainer: Any) -> bool:
    """SFTTrainer's training loss is the model's own causal-LM loss with `num_items_in_batch` (what the pipeline
    computes): its `nll` loss, its own compute_loss, no compute_loss_func, label smoothing or router loss."""
    cls = _trl_class("SFTTrainer")
    return (cls is not None and isinstance(trainer, cls) and type(trainer).compute_loss is cls.compute_loss
            and trainer.args.loss_type == "nll" and trainer.compute_loss_func is None
            and trainer.label_smoother is None and not trainer.aux_loss_enabled)


def trl_problems(trainer: Any) -> List[str]:
    """The TRL options the plugin does not run (refused with the mixin's others, on every rank)."""
    problems: List[str] = []
    pp = trainer.plugin.pp_size > 1
    if is_trl_trainer(trainer) and trainer.aux_loss_enabled:
        problems.append("TRL's router load-balancing loss (a MoE model with router_aux_loss_coef != 0): set "
                        "router_aux_loss_coef=0.0 in the SFTConfig/DPOConfig")
    if is_trl(trainer, "SFTTrainer") and pp and not sft_loss_is_models_own(trainer):
        problems.append("SFTTrainer with loss_type='dft', compute_loss_func, label_smoothing_factor or a "
                        "compute_loss override under pp_size > 1 (the pipeline takes the model's own nll loss): "
                        "use loss_type='nll' and no other loss, or pp_size=1")
    if not is_trl(trainer, "DPOTrainer"):
        return problems
    if trainer.precompute_ref_logps:
        problems.append("DPOConfig(precompute_ref_log_probs=True) (DPOTrainer computes them in __init__, on the "
                        "whole unsharded model): pass ref_model=... instead, which runs on the plugin's layout")
    if trainer.ref_model is None:
        problems.append("DPOTrainer without ref_model (a PEFT policy's disabled adapters): pass ref_model=... (a "
                        "copy of the initial model), which runs on the plugin's layout")
    if trainer.args.sync_ref_model:
        problems.append("DPOConfig(sync_ref_model=True) (the reference model is boosted once, at start): set "
                        "sync_ref_model=False")
    return problems


@dataclass
class WithoutVarlenKeys:
    """A data collator whose batches lack the flash-attention-only keys of TRL's padding-free batches."""
    collator: Callable[[List[Dict[str, Any]]], Dict[str, Any]]

    def __call__(self, examples: List[Dict[str, Any]]) -> Dict[str, Any]:
        return {k: v for k, v in self.collator(examples).items() if k not in VARLEN_KEYS}


def _full_vocab_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The full, unpadded logits: a vocab-parallel LM head's training output gathered over tp (the gradient split
    back to this rank's columns)."""
    from shardformer.layer import ColumnParallelLinear

    head = model.get_output_embeddings()
    if isinstance(head, ColumnParallelLinear) and not head.gathers_output:
        return head.gather(logits)
    return logits


def per_token_fields(logits: torch.Tensor, labels: torch.Tensor, outputs: Tuple[str, ...]) -> Dict[str, torch.Tensor]:
    """TRL's fused-head fields from the full logits (`trl.kernels.chunked_logprob`, temperature 1): the label's
    log-probability, the entropy, log(sum p^2), the mean logit and whether the label is the first argmax; zero where
    the label is -100."""
    mask = labels != -100
    x = logits.float()
    log_z = torch.logsumexp(x, dim=-1)
    log_probs = x.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) - log_z
    fields: Dict[str, torch.Tensor] = {"log_probs": log_probs.masked_fill(~mask, 0.0), "label_mask": mask}
    if "entropy" in outputs:
        probs = (x - log_z.unsqueeze(-1)).exp()
        fields["entropy"] = (log_z - (probs * x).sum(-1)).masked_fill(~mask, 0.0)
    with torch.no_grad():
        if "log_sum_sq_probs" in outputs:
            fields["log_sum_sq_probs"] = torch.logsumexp(2 * x, -1).sub(2 * log_z).masked_fill(~mask, 0.0)
        if "mean_logits" in outputs:
            fields["mean_logits"] = x.mean(-1).masked_fill(~mask, 0.0)
        if "is_top1" in outputs:
            fields["is_top1"] = (x.argmax(-1) == labels) & mask
    return fields


class FusedHeadOnPlugin:
    """A boosted model answering TRL's fused-head calls (`fused_lm_head=True`) with the plugin's own forward;
    other calls pass through."""

    def __init__(self, boosted: nn.Module, outputs: Tuple[str, ...]) -> None:
        self.boosted = boosted
        self.outputs = outputs

    def __call__(self, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return self.boosted(*args, **kwargs)
        from trl.trainer.utils import FusedCausalLMOutput

        labels, shift_labels = kwargs.pop("labels"), kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        if shift_labels is not None:
            raise ValueError("TRL's fused LM head with pre-shifted `shift_labels` (accelerate's context parallelism) "
                             "on the plugin: use the plugin's sp_size for sequence parallelism.")
        kwargs["use_cache"] = False
        out = self.boosted(*args, **kwargs)  # no labels: the full sequence's logits
        logits = _full_vocab_logits(self.boosted.unwrap(), out["logits"])[:, :-1]
        fields = per_token_fields(logits, labels[:, 1:], self.outputs)
        count = fields["label_mask"].sum().clamp(min=1) if num_items is None else num_items
        return FusedCausalLMOutput(loss=-fields["log_probs"].sum() / count, **fields)


FUSED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def attach(trainer: Any) -> Optional[FusedHeadOnPlugin]:
    """After boosting a TRL trainer's model: its reference model boosted (DPO), padding-free batches without the
    varlen keys (SFT), TRL's token count divided by the ranks sharing a batch; the boosted model answering fused-head
    calls, to pass to compute_loss. None for another trainer."""
    if not is_trl_trainer(trainer):
        return None
    if is_trl(trainer, "DPOTrainer"):
        reference, *_ = trainer.booster.boost(trainer.ref_model)
        reference.eval()
        trainer.ref_model = FusedHeadOnPlugin(reference, FUSED_OUTPUTS)
    if getattr(trainer, "padding_free", False):
        trainer.data_collator = WithoutVarlenKeys(trainer.data_collator)
    trainer._tp_size = trainer.get_tp_size()  # TRL divides its world-gathered token count by it
    return FusedHeadOnPlugin(trainer.model_wrapped, FUSED_OUTPUTS)
