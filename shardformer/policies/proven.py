"""A policy proven by one forward before it is used: when the model is sharded (`check_tp`, on every rank before any
collective of the real model), a small twin of the model runs one forward and backward sharded with this policy and
whole, and the policy is refused unless losses, module outputs and gradients agree (prove.py). Inferred policies
(inferred.py) are proven so; so are hand-written ones whose family has variants a plan may not fit (falcon.py)."""
from __future__ import annotations

import copy

from .base import Policy


class ProvenPolicy(Policy):
    """A Policy that proves itself on a twin of the model when the model is sharded (module docstring)."""

    source = "hand-written"   # said in logs and refusals: "inferred" or "hand-written"
    _is_twin = False          # the copy the proof shards: not proven again

    def twin_policy(self) -> "ProvenPolicy":
        """The same plan, for the twin (same class and structure, so the same paths); not proven again."""
        twin = copy.copy(self)
        twin._is_twin = True
        return twin

    def check_tp(self, config, tp_size: int) -> None:
        super().check_tp(config, tp_size)
        if not self._is_twin:
            from ..prove import prove_policy  # (prove.py drives the sharder, which imports the policies)
            prove_policy(self)
