"""Where the unsharded model's layers and parameters live over the pipeline: one frozen value, decided once on the
unsharded model (after sharding a stage holds its own part only), read by the release of a stage, activation
checkpointing and checkpoint IO."""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Dict, Iterable, List, Mapping, Tuple

__all__ = ["StagePlacement", "place"]


@dataclass(frozen=True)
class StagePlacement:
    """The pipeline split of the unsharded model and the stages holding each of its parameters."""
    stacks: Tuple[int, ...]                 # layers of each layer list, in pipeline order (encoder, decoder)
    split: Tuple[int, ...]                  # layers of each virtual stage ((all layers,) without a pipeline)
    stages: Mapping[str, Tuple[int, ...]]   # parameter name (model-relative, tied names too) -> pipeline ranks
    shared: Tuple[Mapping[int, str], ...]   # parameters held by several stages: {pipeline rank: its name there}

    @property
    def num_layers(self) -> int:
        return sum(self.stacks)

    def stage_of_param(self, name: str) -> Tuple[int, ...]:
        """The pipeline ranks holding parameter `name` of the unsharded model."""
        try:
            return self.stages[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a parameter of the unsharded model; give a name of "
                           f"model.named_parameters() before boosting (e.g. {next(iter(self.stages), None)!r})."
                           ) from None

    def shared_names(self) -> List[Dict[int, str]]:
        """`shared` as ColossalAI's Policy returns it: a list of {stage: name}."""
        return [dict(names) for names in self.shared]


def place(stacks: Tuple[int, ...], split: Tuple[int, ...], named: Iterable[Tuple[str, object]],
          stage_of: Callable[[str], Tuple[int, ...]]) -> StagePlacement:
    """The placement of the parameters `named` (name, parameter; tied ones under each name) by `stage_of`."""
    stages: Dict[str, Tuple[int, ...]] = {}
    by_id: Dict[int, Dict[int, str]] = {}
    for name, param in named:
        stages[name] = stage_of(name)
        names = by_id.setdefault(id(param), {})
        for stage in stages[name]:
            names.setdefault(stage, name)
    shared = tuple(MappingProxyType(names) for names in by_id.values() if len(names) > 1)
    return StagePlacement(stacks, split, MappingProxyType(stages), shared)
