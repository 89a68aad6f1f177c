"""A policy to be proven by one forward before it is used: when the model is sharded (the sharder's policy step,
`prepare_plan`, runs the context's `prove` after the policy's checks and before its plan is made, on every rank
before any collective of the real model; booster_plugin's prepare passes prove.prove_policy), a small twin of the
model runs one forward and backward sharded with this policy and whole, and the policy is refused unless losses,
module outputs and gradients agree. Inferred policies (inferred.py) are proven so; so are hand-written ones whose
family has variants a plan may not fit (falcon.py)."""
from __future__ import annotations

import copy

from .base import Policy


class ProvenPolicy(Policy):
    """A Policy that proves itself on a twin of the model when the model is sharded (module docstring)."""

    source = "hand-written"   # said in logs and refusals: "inferred" or "hand-written"

    def twin_policy(self) -> "ProvenPolicy":
        """The same plan, for the twin (same class and structure, so the same paths)."""
        return copy.copy(self)
