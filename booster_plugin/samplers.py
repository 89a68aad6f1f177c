"""StatefulDistributedSampler: ColossalAI's sampler that resumes mid-epoch (its SFT / RLHF scripts pass it to
`plugin.prepare_dataloader(..., distributed_sampler_cls=StatefulDistributedSampler)`)."""
from __future__ import annotations

from typing import Iterator, Optional

from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

__all__ = ["StatefulDistributedSampler"]


class StatefulDistributedSampler(DistributedSampler):
    """A DistributedSampler that skips the first `start_index` of this rank's samples of each epoch (after the
    shuffle of `set_epoch`), as ColossalAI's: `set_start_index(step * batch_size)` resumes an epoch after `step`
    batches; `len()` counts the samples left. The start stays until set again (set it to 0 for the next epoch)."""

    def __init__(self, dataset: Dataset, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.start_index = 0

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[self.start_index:])

    def __len__(self) -> int:
        return self.num_samples - self.start_index

    def set_start_index(self, start_index: int) -> None:
        self.start_index = start_index
