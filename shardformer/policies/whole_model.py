"""The policy of any model where nothing is split inside it (tp = pp = 1, no sequence or expert parallelism: ZeRO and
data parallel only, LowLevelZeroPlugin's case): no layer list, no plan. ColossalAI's LowLevelZeroPlugin takes any
nn.Module; so does ours through this policy, used only where the model has no policy of its own."""
from __future__ import annotations

from typing import Dict, List

from torch import nn

from .base import Policy

__all__ = ["WholeModelPolicy"]


class WholeModelPolicy(Policy):
    """No layers to split or checkpoint, nothing shared between stages (there is one)."""

    @property
    def base_prefix(self) -> str:
        return ""

    def layer_list(self) -> nn.ModuleList:
        return nn.ModuleList()

    def num_layers(self) -> int:
        return 0

    def check_paths(self) -> None:
        return None

    def shared_param_names(self) -> List[Dict[int, str]]:
        return []
