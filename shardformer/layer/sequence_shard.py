"""A sequence shard (split_gather sequence parallelism) that the column layers of one tp region read as the full,
all-gathered sequence, keeping only the shard for their backward."""
from __future__ import annotations

from torch import Tensor
from torch.distributed import ProcessGroup

from .comm import all_gather_along

__all__ = ["SequenceShard", "split_dim"]


def split_dim(x: Tensor, sequence_dim: int) -> int:
    """The dimension `x`, a sequence shard, is split along: `sequence_dim` of [batch, sequence, ...] hidden states,
    or 0 where the model flattened them to [tokens, hidden] (OPT's MLP): each rank's rows are then its own tokens,
    gathered and reduce-scattered back in the same order."""
    return sequence_dim if x.dim() > 2 else 0


class SequenceShard:
    """A sequence shard that column layers read as the full, all-gathered sequence: the layers sharing it (q, k and
    v of one attention) keep only the shard for backward, and the first of them to need the full input there gathers
    it once for all (it is dropped when the last one has used it).

    Args:
        dim: the sequence dimension.
        group: the tp group the sequence is split over.
    """

    def __init__(self, dim: int, group: ProcessGroup | None) -> None:
        self.dim, self.group = dim, group
        self.readers = 0  # column layers that read it in forward; each gathers (or reuses) it once in backward
        self._full: Tensor | None = None

    def gather(self, shard: Tensor, needed: bool = True) -> Tensor | None:
        """The full input again, in backward (a collective: every tp rank runs the same backward); `needed=False`
        only signs off a reader that needs no weight gradient."""
        full = self._full
        if needed and full is None:
            full = all_gather_along(shard, self.dim, self.group)
        self.readers -= 1
        self._full = full if self.readers > 0 else None
        return full

