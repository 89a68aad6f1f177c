"""Trainer's dataloaders sharded over data-parallel replicas instead of over the world: the tp, pp and sp ranks of
one replica get the same batches (`per_device_train_batch_size` rows each), replica r the batches accelerate would give
process r of `dp_size` processes. Trainer's own collator, column removal, samplers and worker seeding are kept; only
the sharding (accelerate's `prepare_data_loader`) is told the replica count instead of the world size."""
from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple, Optional

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader, Dataset, IterableDataset
from transformers import TrainingArguments
from transformers.trainer_utils import seed_worker


class Replica(NamedTuple):
    """This rank's data-parallel replica: `index` of `count`."""
    index: int
    count: int


def dataloader_params(args: TrainingArguments, batch_size: int, collate_fn: Callable) -> dict:
    """The DataLoader arguments Trainer builds from its TrainingArguments (Trainer._get_dataloader)."""
    return {"batch_size": batch_size, "collate_fn": collate_fn, "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory, "persistent_workers": args.dataloader_persistent_workers,
            "multiprocessing_context": args.dataloader_multiprocessing_context,
            "prefetch_factor": args.dataloader_prefetch_factor, "in_order": args.dataloader_in_order}


def replica_dataloader(dataset: Dataset, params: dict, sampler: Optional[torch.utils.data.Sampler],
                       is_training: bool, args: TrainingArguments, accelerator: Accelerator,
                       replica: Replica) -> DataLoader:
    """`DataLoader(dataset, **params)` with Trainer's sampler, sharded over the replicas by accelerate (batch i of the
    sampler's order to replica i % count; seedable sampler and RNG synchronisation as accelerate's own)."""
    params = dict(params)
    if not isinstance(dataset, IterableDataset):
        if sampler is not None:
            params["sampler"] = sampler
        params["drop_last"] = args.dataloader_drop_last
        if is_training:  # the worker seeds of Trainer, per replica
            params["worker_init_fn"] = partial(seed_worker, num_workers=args.dataloader_num_workers,
                                               rank=replica.index)
    return prepare_data_loader(
        DataLoader(dataset, **params), accelerator.device, num_processes=replica.count, process_index=replica.index,
        split_batches=accelerator.split_batches, put_on_device=True, rng_types=list(accelerator.rng_types or []),
        dispatch_batches=False, even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler, data_seed=args.data_seed,
        non_blocking=accelerator.non_blocking)
