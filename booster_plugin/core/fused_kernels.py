"""Fused normalization kernels from Liger-Kernel (`HybridParallelPlugin(fused_kernels="liger")`, and ColossalAI's
`enable_fused_normalization` where Liger can run): the model's RMSNorm and LayerNorm modules are replaced, on this
model instance only, by Liger's `LigerRMSNorm` / `LigerLayerNorm` holding the same parameters (same names, same
parameter objects). Transformers' classes are never patched (Liger's own `apply_liger_kernel_to_*` functions
replace classes in transformers' modules, for every model of the process: not used).

Which Liger variant equals a model's norm is not guessed from its name: each distinct norm class is checked once
on the device against Liger's llama-style RMSNorm (weight * x / rms, computed in fp32) and gemma-style one
((1 + weight) * ..., Gemma); a class neither matches stays as it is, and the plugin says so on rank 0.

Liger's kernels are Triton, CUDA only: on CPU, or where liger_kernel is not installed (`pip install
hybrid-parallel[liger]`), an explicit `fused_kernels="liger"` is refused; ColossalAI's switch falls back to the
compiled decoder layers (compile_layers), whose graphs fuse the norms instead.
"""
from __future__ import annotations

import copy
import importlib.util
from typing import Callable, Dict, List, NamedTuple, Optional

import torch
from torch import nn

__all__ = ["FUSED_KERNELS", "liger_unusable", "use_liger_norms"]

FUSED_KERNELS = (None, "liger")
# the RMSNorm variants Liger implements, tried in this order: (offset, casting mode, in place)
_RMS_VARIANTS = ((0.0, "llama", True), (1.0, "gemma", False))
_CHECK_TOL = 1e-5  # fp32, on a random input: a matching variant differs by rounding only


def liger_unusable(device: torch.device) -> Optional[str]:
    """Why Liger's kernels cannot run here (None: they can)."""
    if torch.device(device).type != "cuda":
        return f"Liger-Kernel's kernels are Triton kernels for CUDA GPUs; this run is on {torch.device(device).type}"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel is not installed (pip install liger-kernel, or this package's extra: [liger])"
    return None


class _Candidate(NamedTuple):
    name: str
    make: Callable[[nn.Module], nn.Module]  # the Liger module for a norm (parameters not yet shared)


def _rms_eps(module: nn.Module) -> Optional[float]:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return eps if isinstance(eps, float) else None


def _candidates(module: nn.Module) -> List[_Candidate]:
    """Liger modules that may compute what `module` computes (none for modules that are no norm we know)."""
    from liger_kernel.transformers import LigerLayerNorm, LigerRMSNorm
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.LayerNorm):
        if weight is None or module.bias is None or len(module.normalized_shape) != 1:
            return []  # LigerLayerNorm always holds an affine weight and bias
        return [_Candidate("LigerLayerNorm", lambda m: LigerLayerNorm(m.normalized_shape[0], m.eps, bias=True))]
    if not type(module).__name__.endswith("RMSNorm") or not isinstance(weight, nn.Parameter) or weight.dim() != 1 \
            or _rms_eps(module) is None:
        return []
    return [_Candidate(f"LigerRMSNorm({casting})", lambda m, o=offset, c=casting, i=in_place: LigerRMSNorm(
        m.weight.shape[0], _rms_eps(m), offset=o, casting_mode=c, in_place=i)) for offset, casting, in_place in
            _RMS_VARIANTS]


def _share(liger: nn.Module, module: nn.Module) -> nn.Module:
    """`liger` holding `module`'s parameter objects (optimizer, hooks and names unchanged)."""
    for name, param in module.named_parameters(recurse=False):
        setattr(liger, name, param)
    return liger


@torch.no_grad()
def _matching(module: nn.Module, device: torch.device) -> Optional[_Candidate]:
    """The first candidate equal to `module` on a random fp32 input on `device`."""
    twin = copy.deepcopy(module).to_empty(device=device).float()  # (a lazily built model's norms are on meta)
    for p in twin.parameters():
        p.uniform_(-1, 1)
    x = torch.randn(4, 8, twin.weight.shape[0], device=device)
    want = twin(x)
    for candidate in _candidates(module):
        got = _share(candidate.make(twin), twin)(x.clone())
        if got.shape == want.shape and torch.allclose(got, want, atol=_CHECK_TOL, rtol=_CHECK_TOL):
            return candidate
    return None


def use_liger_norms(model: nn.Module, device: torch.device) -> Dict[str, List[str]]:
    """Replace the norms of `model` by Liger's where one equals them; returns {norm class: [what replaced it]} for
    every norm class seen (an empty list: left as it is)."""
    verdict: Dict[type, Optional[_Candidate]] = {}
    for path, module in list(model.named_modules()):
        if not path or not _candidates(module):
            continue
        if type(module) not in verdict:
            verdict[type(module)] = _matching(module, device)
        candidate = verdict[type(module)]
        if candidate is not None:
            parent, _, name = path.rpartition(".")
            liger = _share(candidate.make(module), module)
            setattr(model.get_submodule(parent) if parent else model, name, liger)
    return {cls.__name__: [c.name] if c is not None else [] for cls, c in verdict.items()}
