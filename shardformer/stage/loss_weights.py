"""Counts of loss items in a batch, for `HybridParallelPlugin(loss_weight_fn=...)`: microbatches (and replicas)
are then weighted by how many label tokens they hold, so padded batches train exactly like one process."""
import torch

from pipeline.step import MicroBatch


def causal_lm_label_tokens(batch: MicroBatch, ignore_index: int = -100) -> torch.Tensor:
    """Tokens a causal LM loss averages over: labels are shifted by one, so each sample's first label is unused."""
    return (batch["labels"][..., 1:] != ignore_index).sum()


def label_tokens(batch: MicroBatch, ignore_index: int = -100) -> torch.Tensor:
    """Tokens an unshifted token loss (masked LM, token classification) averages over."""
    return (batch["labels"] != ignore_index).sum()
