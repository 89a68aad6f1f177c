"""TRL's DPOTrainer under pipeline parallelism: one pipeline step per accumulation window.

TRL batches a step's pairs as rows [chosen; rejected]. Each batch of the window is reordered pair-major (c0, r0, c1,
r1, ...), so that the pipeline's contiguous microbatch split keeps pairs together. The reference model's per-sequence
log-probabilities come first, from a forward-only pipeline pass of the boosted reference model (the last stage
computes them from its logits; only the last stage needs them). The policy's step then runs with a criterion that, on
the last stage, computes the microbatch's per-sequence log-probabilities from its logits (vocab-gathered under tp) and
TRL's sigmoid DPO loss of its pairs, weighted so that the pipeline's mean over microbatches is TRL's mean over the
window's pairs (what Trainer's per-batch steps of one process add up to: equal batches, each its mean / window).
TRL's reward and log-probability metrics are the window's means over every replica's pairs (one entry per window,
equal to the mean of TRL's per-batch entries); its entropy, token accuracy, mean logits and token count are not logged.

The model's forward sees only input_ids and attention_mask; the completion masks and reference log-probabilities are
the criterion's, taken in microbatch order (the last stage runs its forwards in that order; checked against each
microbatch's input_ids)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.groups import world_group
from pipeline.step import MicroBatch

from .trl_support import _full_vocab_logits, per_token_fields

Batch = MicroBatch
MODEL_KEYS = ("input_ids", "attention_mask")
# TRL's reward and log-probability metrics, as per-pair sums (then the pair count): their means over the window
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def dpo_pipeline_problems(trainer: Any) -> List[str]:
    """DPOTrainer options the pipeline step does not run (it computes the sigmoid loss of reverse-KL DPO)."""
    from trl import DPOTrainer

    problems: List[str] = []
    if list(trainer.loss_types) != ["sigmoid"] or trainer.f_divergence_type != "reverse_kl":
        problems.append(f"DPOConfig(loss_type={list(trainer.loss_types)}, f_divergence_type="
                        f"{trainer.f_divergence_type!r}) under pp_size > 1 (the pipeline step computes DPO's sigmoid "
                        f"loss): use loss_type='sigmoid' and f_divergence_type='reverse_kl', or pp_size=1")
    pipeline = trainer.plugin.config.pipeline
    if pipeline.num_microbatches is None and (pipeline.microbatch_size or 1) % 2:
        problems.append("DPOTrainer under pp_size > 1 without num_microbatches, or with an odd microbatch_size (the "
                        "pipeline would split (chosen, rejected) pairs): give HybridParallelPlugin(num_microbatches="
                        "...) dividing each accumulation window's pairs, or an even microbatch_size")
    if trainer.plugin.sp_mode is not None:
        problems.append(f"DPOTrainer with sequence parallelism ({trainer.plugin.sp_mode!r}) under pp_size > 1 (the "
                        f"criterion reads whole-sequence logits, not checked under sp): use sp with pp_size=1, or pp "
                        f"without sp")
    if trainer.ld_alpha is not None or trainer.use_weighting:
        problems.append("DPOConfig(ld_alpha=...) or use_weighting=True under pp_size > 1: drop them, or use pp_size=1")
    if type(trainer).compute_loss is not DPOTrainer.compute_loss or \
            type(trainer)._compute_loss is not DPOTrainer._compute_loss:
        problems.append("a DPOTrainer compute_loss override under pp_size > 1 (the pipeline computes DPO's loss "
                        "itself): use pp_size=1")
    return problems


def pair_major(batch: Batch) -> Batch:
    """TRL's [chosen; rejected] rows reordered (c0, r0, c1, r1, ...), model inputs and completion mask only."""
    rows = batch["input_ids"].shape[0]
    pairs = rows // 2
    order = torch.stack([torch.arange(pairs), torch.arange(pairs) + pairs], dim=1).flatten()
    return {key: batch[key][order.to(batch[key].device)] for key in (*MODEL_KEYS, "completion_mask")}


def sequence_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its completion tokens (TRL's `logps`), from the full-vocabulary logits."""
    labels = input_ids.masked_fill(completion_mask == 0, -100)
    return per_token_fields(logits[:, :-1], labels[:, 1:], ())["log_probs"].sum(dim=1)


@dataclass
class DPOCriterion:
    """The policy step's criterion: DPO's sigmoid loss of a microbatch's pairs against the reference log-probs,
    as its share of the mean over the window's `pairs`, times the number of (equal) microbatches."""
    model: torch.nn.Module
    input_ids: torch.Tensor
    completion_mask: torch.Tensor
    reference_logps: torch.Tensor
    beta: float
    loss_weight: float
    offset: int = 0
    sums: torch.Tensor = field(default_factory=lambda: torch.zeros(len(METRICS) + 1, dtype=torch.float64))

    def __call__(self, outputs: Any, micro_batch: Batch) -> torch.Tensor:
        input_ids = micro_batch["input_ids"]
        rows, total = input_ids.shape[0], self.completion_mask.shape[0]
        if rows % 2:
            raise ValueError(f"DPOTrainer under pipeline parallelism: a microbatch of {rows} rows splits a (chosen, "
                             f"rejected) pair; give the plugin num_microbatches or microbatch_size that divide the "
                             f"window's {total // 2} pairs into whole pairs.")
        window = slice(self.offset, self.offset + rows)
        self.offset += rows
        if not torch.equal(input_ids, self.input_ids[window]):
            raise RuntimeError("DPOTrainer under pipeline parallelism: the last stage's microbatches came out of order "
                               "(this schedule does not run its forwards in microbatch order); use pp_style='1f1b'.")
        logits = _full_vocab_logits(self.model, outputs["logits"])
        logps = sequence_logps(logits, input_ids, self.completion_mask[window]).view(-1, 2)
        ratios = logps - self.reference_logps[window].view(-1, 2)
        per_pair = -F.logsigmoid(self.beta * (ratios[:, 0] - ratios[:, 1])) * self.loss_weight
        self._count(logps.detach(), self.beta * ratios.detach())
        return per_pair.sum() / (total // 2) * (total / rows)


    def _count(self, logps: torch.Tensor, rewards: torch.Tensor) -> None:
        chosen, rejected = rewards[:, 0], rewards[:, 1]
        values = (chosen, rejected, (chosen > rejected).float(), chosen - rejected, logps[:, 0], logps[:, 1])
        self.sums += torch.stack([v.double().sum().cpu() for v in values] + [torch.tensor(float(len(chosen)))])


def window_metrics(sums: torch.Tensor) -> Dict[str, float]:
    """TRL's metrics over every replica's pairs of the window (collective over the world: the last stage's ranks
    hold the sums, each replica's as often as the others')."""
    dist.all_reduce(sums, group=world_group())
    return {name: float(sums[i] / sums[-1]) for i, name in enumerate(METRICS)}


def reference_logps(booster, reference: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The reference model's per-sequence log-probs of `batch` (a forward-only pipeline pass); on the last stage, an
    empty tensor elsewhere (only the last stage's criterion reads them)."""
    inputs = {key: batch[key] for key in MODEL_KEYS}
    with torch.no_grad():
        out = booster.execute_pipeline(iter([inputs]), reference, None, None, return_loss=False,
                                       return_outputs=True)
    if out["outputs"] is None:
        return torch.empty(0)
    # the merged outputs' logits are gathered over tp already
    return sequence_logps(out["outputs"]["logits"], batch["input_ids"], batch["completion_mask"])


def dpo_pipeline_loss(trainer: Any, model: torch.nn.Module, batches: List[Batch]) -> torch.Tensor:
    """One policy step over the window's batches (pair-major), its loss on every rank."""
    from .pipeline_step import concat_batches

    batch = trainer._prepare_inputs(concat_batches([pair_major(b) for b in batches]))
    reference = reference_logps(trainer.booster, trainer.ref_model.boosted, batch)
    criterion = DPOCriterion(model.unwrap(), batch["input_ids"], batch["completion_mask"], reference, trainer.beta,
                             float(trainer.loss_weights[0]))
    inputs = {key: batch[key] for key in MODEL_KEYS}
    out = trainer.booster.execute_pipeline(iter([inputs]), model, criterion, trainer.optimizer, return_loss=True)
    for name, value in window_metrics(criterion.sums).items():  # one entry per window: TRL logs their mean
        trainer._metrics["train"][name].append(value)
    return out["loss"]
