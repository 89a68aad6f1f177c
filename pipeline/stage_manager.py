"""Which pipeline stage this rank is, its neighbours, and which layers each stage (or virtual stage) holds."""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch.distributed as dist

from .layout import LOOP, V, StageLayout

AUTO = "auto"


class StageCosts(NamedTuple):
    """Estimated compute of a model, in any unit: per layer, and the work only the first / last stage does
    (embeddings; final norm, head and loss)."""
    layers: Sequence[float]
    first: float
    last: float


def balanced_split(costs: StageCosts, num_parts: int) -> List[int]:
    """Contiguous layer counts (each >= 1) for `num_parts` stages minimizing the most expensive stage (then the
    sum of squared stage costs), the first stage also paying `costs.first` and the last `costs.last`.

    Args:
        costs: per-layer costs and the extra work of the first and last stage.
        num_parts: number of (virtual) stages.
    """
    layers, n = list(costs.layers), len(costs.layers)
    if n < num_parts:
        raise ValueError(f"Cannot split {n} layers over {num_parts} pipeline stages: every stage needs a layer.")
    prefix = [0.0]
    for c in layers:
        prefix.append(prefix[-1] + c)

    def part(i: int, j: int, k: int) -> float:  # layers [i, j) as stage k
        return prefix[j] - prefix[i] + (costs.first if k == 0 else 0.0) + (costs.last if k == num_parts - 1 else 0.0)

    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]  # best[k][j]: first j layers in k stages
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_parts + 1):
        for j in range(k, n - (num_parts - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                c = part(i, j, k - 1)
                cand = (max(best[k - 1][i][0], c), best[k - 1][i][1] + c * c)
                if cand < best[k][j]:
                    best[k][j], cut[k][j] = cand, i
    split, j = [], n
    for k in range(num_parts, 0, -1):
        split.append(j - cut[k][j])
        j = cut[k][j]
    return split[::-1]
from .mesh import ProcessGroupMesh


class PipelineStageManager:
    """Stage bookkeeping along the mesh's pipeline axis.

    With `num_model_chunks` > 1 each rank holds several model chunks (virtual stages), placed by `layout_style`
    (pipeline/layout.py): "loop" (chunk c of stage s is virtual stage `c * num_stages + s`) or "v" (zero-bubble V).
    `is_first_stage` / `is_last_stage` say whether this rank holds the first / last virtual stage.

    Args:
        pg_mesh: the process-group mesh.
        pipeline_axis: its pipeline axis.
        num_model_chunks: chunks per rank.
        num_layers_per_stage: layers of each virtual stage (None: even split; "auto": balanced by cost, see
            `layers_per_virtual_stage`).
        layout_style: "loop" or "v".
    """

    def __init__(self, pg_mesh: ProcessGroupMesh, pipeline_axis: int, num_model_chunks: int = 1,
                 num_layers_per_stage: Union[None, str, Sequence[int]] = None, layout_style: str = LOOP) -> None:
        if isinstance(num_layers_per_stage, str) and num_layers_per_stage != AUTO:
            raise ValueError(f"num_layers_per_stage must be a list of layer counts, None or 'auto', "
                             f"got {num_layers_per_stage!r}.")
        self.pg_mesh = pg_mesh
        self.pipeline_axis = pipeline_axis
        self.num_stages = pg_mesh.size(pipeline_axis)
        self.stage = pg_mesh.coordinate[pipeline_axis]
        self.num_model_chunks = num_model_chunks
        self.layout = StageLayout(self.num_stages, num_model_chunks, layout_style)
        self.num_layers_per_stage = num_layers_per_stage if num_layers_per_stage in (None, AUTO) \
            else list(num_layers_per_stage)
        self.stage_ranks: Tuple[int, ...] = pg_mesh.ranks_along_axis(pipeline_axis)
        self.pp_group = pg_mesh.get_group_along_axis(pipeline_axis)
        # ColossalAI's flag of the zero-bubble V layout (pp_style "zbv"; here also "dualpipev", the same V)
        self.use_zbv = layout_style == V
        self._stage_indices: Union[None, Tuple[int, int], List[Tuple[int, int]]] = None

    def get_rank(self) -> int:
        """This process's global rank (ColossalAI's)."""
        return dist.get_rank()

    @property
    def stage_indices(self) -> Union[Tuple[int, int], List[Tuple[int, int]]]:
        """[start, end) of the layers this stage holds, a list of them (one per chunk) with several chunks: as
        ColossalAI's, set when the model is sharded (`get_stage_index` of the model's layer split)."""
        if self._stage_indices is None:
            raise AttributeError("stage_indices is set when the model is sharded: read it after booster.boost(model).")
        return self._stage_indices

    @stage_indices.setter
    def stage_indices(self, indices: Union[Tuple[int, int], List[Tuple[int, int]]]) -> None:
        self._stage_indices = indices

    # -- position ---------------------------------------------------------------------------------------
    def _holds(self, virtual_stage: int, ignore_chunk: bool) -> bool:
        if ignore_chunk:  # the physical stage
            return self.stage == (0 if virtual_stage == 0 else self.num_stages - 1)
        return self.layout.rank_of(virtual_stage) == self.stage

    def is_first_stage(self, ignore_chunk: bool = False) -> bool:
        return self._holds(0, ignore_chunk)

    def is_last_stage(self, ignore_chunk: bool = False) -> bool:
        return self._holds(self.layout.num_stages - 1, ignore_chunk)

    def rank_of_stage(self, stage: int) -> int:
        return self.stage_ranks[stage % self.num_stages]

    @property
    def prev_rank(self) -> int:
        return self.rank_of_stage(self.stage - 1)

    @property
    def next_rank(self) -> int:
        return self.rank_of_stage(self.stage + 1)

    @property
    def first_rank(self) -> int:
        return self.stage_ranks[0]

    @property
    def last_rank(self) -> int:
        """The rank holding the last virtual stage (the loss)."""
        return self.stage_ranks[self.layout.rank_of(self.layout.num_stages - 1)]

    # -- layer split ------------------------------------------------------------------------------------
    @staticmethod
    def distribute_layers(num_layers: int, num_stages: int) -> List[int]:
        """Even split; the remainder goes to the middle stages (the first holds embeddings, the last the head)."""
        if num_layers < num_stages:
            raise ValueError(f"Cannot split {num_layers} layers over {num_stages} pipeline stages: every stage "
                             f"needs at least one layer. Use pp_size <= {num_layers}.")
        quotient, remainder = divmod(num_layers, num_stages)
        layers = [quotient] * num_stages
        start = num_stages // 2 - remainder // 2
        for i in range(start, start + remainder):
            layers[i] += 1
        return layers

    def layers_per_virtual_stage(self, num_layers: int, costs: Optional[Callable[[], StageCosts]] = None) -> List[int]:
        """Layers of each virtual stage (num_stages * num_model_chunks of them): the user's list, else balanced
        by `costs()` with num_layers_per_stage="auto", else an even split.

        Args:
            num_layers: layers of the whole model.
            costs: the estimated cost of each layer and of the work before / after them (needed for "auto").
        """
        total = self.num_stages * self.num_model_chunks
        if self.num_layers_per_stage == AUTO:
            if costs is None:
                raise ValueError("num_layers_per_stage='auto' needs the layers' estimated costs.")
            return balanced_split(costs(), total)
        if self.num_layers_per_stage is None:
            if self.num_model_chunks > 1 and num_layers < total:
                raise ValueError(f"Cannot split {num_layers} layers over {total} virtual pipeline stages "
                                 f"({self.num_model_chunks} chunks on each of {self.num_stages} stages): every chunk "
                                 f"needs at least one layer.")
            return self.distribute_layers(num_layers, total)
        split = self.num_layers_per_stage
        if len(split) != total or sum(split) != num_layers or min(split) < 1:
            raise ValueError(f"num_layers_per_stage={split} must have {total} positive entries summing to "
                             f"the model's {num_layers} layers.")
        return list(split)

    def get_stage_index(self, layers_per_stage: Sequence[int], stage: Optional[int] = None,
                        num_model_chunks: Optional[int] = None) -> Union[Tuple[int, int], List[Tuple[int, int]]]:
        """[start, end) of the layers `stage` holds; a list of them, one per chunk, with several chunks."""
        stage = self.stage if stage is None else stage
        chunks = self.num_model_chunks if num_model_chunks is None else num_model_chunks
        bounds = [0]
        for n in layers_per_stage:
            bounds.append(bounds[-1] + n)
        indices = []
        for c in range(chunks):
            v = self.layout.stage_of(stage, c)
            indices.append((bounds[v], bounds[v + 1]))
        return indices[0] if chunks == 1 else indices
