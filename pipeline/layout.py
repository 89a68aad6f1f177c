"""Where each virtual stage (model chunk) of a pipeline lives: which rank, which of the rank's chunks.

Two layouts, as in torch.distributed.pipelining:
- "loop" (1F1B, interleaved): virtual stage `c * p + r` is chunk `c` of rank `r`, so a rank holds `v` non-adjacent
  chunks and activations go round the ranks `v` times.
- "v" (zero-bubble V): two chunks per rank; rank `r` holds virtual stages `r` and `2p - 1 - r`, so the first and the
  last virtual stage (embeddings and head) are both on rank 0 and the turn of the V stays on rank `p - 1`.
"""
from __future__ import annotations

from typing import NamedTuple

LOOP, V = "loop", "v"


class StageLayout(NamedTuple):
    """`num_ranks` pipeline ranks, `num_chunks` model chunks on each, placed by `style` ("loop" or "v")."""
    num_ranks: int
    num_chunks: int = 1
    style: str = LOOP

    @property
    def num_stages(self) -> int:
        """Virtual stages in all."""
        return self.num_ranks * self.num_chunks

    def rank_of(self, stage: int) -> int:
        """The rank holding virtual stage `stage`."""
        chunk, pos = divmod(stage, self.num_ranks)
        return self.num_ranks - 1 - pos if self.style == V and chunk % 2 else pos

    def chunk_of(self, stage: int) -> int:
        """Which of its rank's chunks virtual stage `stage` is."""
        return stage // self.num_ranks

    def stage_of(self, rank: int, chunk: int) -> int:
        """The virtual stage that is chunk `chunk` of `rank`."""
        pos = self.num_ranks - 1 - rank if self.style == V and chunk % 2 else rank
        return chunk * self.num_ranks + pos

    def stages_of(self, rank: int) -> list:
        """The virtual stages `rank` holds, chunk by chunk."""
        return [self.stage_of(rank, c) for c in range(self.num_chunks)]
