"""Policy checker: does a model (or a custom policy) train exactly under tp x pp? See `python -m hp_check`."""
from .compare import Verdict, compare

__all__ = ["Verdict", "compare"]
