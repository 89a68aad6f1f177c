"""`colossalai.tensor`: ColossalAI's distributed-tensor helpers, as far as its tests use them (see its submodules)."""
