"""`colossalai.testing.comparison`: ColossalAI's test assertions (tensors through torch.testing.assert_close)."""
from __future__ import annotations

from typing import Any, List, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.testing import assert_close
from torch.utils._pytree import tree_flatten

__all__ = ["assert_equal", "assert_not_equal", "assert_close", "assert_close_loose", "assert_equal_in_group",
           "check_state_dict_equal", "check_state_dict_equal_pytree", "assert_hf_output_close"]


def assert_equal(a: Tensor, b: Tensor) -> None:
    assert torch.all(a == b), f"expected a and b to be equal but they are not, {a} vs {b}"


def assert_not_equal(a: Tensor, b: Tensor) -> None:
    assert not torch.all(a == b), f"expected a and b to be not equal but they are, {a} vs {b}"


def assert_close_loose(a: Tensor, b: Tensor, rtol: float = 1e-3, atol: float = 1e-3) -> None:
    assert_close(a, b, rtol=rtol, atol=atol)


def assert_equal_in_group(tensor: Tensor, process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Every rank of the group holds the same tensor (all-gathered and compared pairwise)."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(gathered, tensor, group=process_group)
    for i in range(len(gathered) - 1):
        assert torch.all(gathered[i] == gathered[i + 1]), \
            f"expected tensors on rank {i} and {i + 1} to be equal but they are not, {gathered[i]} vs {gathered[i + 1]}"


def _tensors_close(v1: Tensor, v2: Any, ignore_device: bool, ignore_dtype: bool) -> None:
    assert isinstance(v2, Tensor), f"a tensor compared with {type(v2).__name__}"
    if not ignore_device:
        v1, v2 = v1.to("cpu"), v2.to("cpu")
    if ignore_dtype:
        v1 = v1.to(v2.dtype)
    assert_close_loose(v1, v2)


def _values_equal(v1: Any, v2: Any, ignore_device: bool, ignore_dtype: bool) -> None:
    """ColossalAI's rule: dicts recursively, lists element by element (the other side must be a list too: a tuple
    is not equal to a list), tensors within 1e-3, anything else by ==."""
    if isinstance(v1, dict):
        assert isinstance(v2, dict), f"a dict compared with {type(v2).__name__}"
        check_state_dict_equal(v1, v2, ignore_device)
    elif isinstance(v1, list):
        assert isinstance(v2, list), f"a list compared with {type(v2).__name__}"
        for a, b in zip(v1, v2):
            _values_equal(a, b, ignore_device, ignore_dtype)
    elif isinstance(v1, Tensor):
        _tensors_close(v1, v2, ignore_device, ignore_dtype)
    else:
        assert v1 == v2, f"{v1} not equals to {v2}"


def check_state_dict_equal(d1: Mapping, d2: Mapping, ignore_device: bool = True, ignore_dtype: bool = False) -> None:
    """The two state dicts have the same keys and equal values (tensors within rtol = atol = 1e-3)."""
    assert len(d1) == len(d2), f"Number of keys unequal: {len(d1)} vs {len(d2)}"
    for key, v1 in d1.items():
        assert key in d2, f"key {key!r} missing from the second state dict"
        _values_equal(v1, d2[key], ignore_device, ignore_dtype)


def check_state_dict_equal_pytree(d1: Mapping, d2: Mapping, ignore_device: bool = True) -> None:
    """As check_state_dict_equal, on the flattened leaves (containers of any kind)."""
    flat1, flat2 = tree_flatten(d1)[0], tree_flatten(d2)[0]
    assert len(flat1) == len(flat2), f"{len(flat1)} vs {len(flat2)} leaves"
    for v1, v2 in zip(flat1, flat2):
        if isinstance(v1, Tensor):
            _tensors_close(v1, v2, ignore_device, False)
        else:
            assert v1 == v2, f"{v1} not equals to {v2}"


def assert_hf_output_close(out1: Any, out2: Any, ignore_keys: Optional[List[str]] = None, track_name: str = "",
                           atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Two Hugging Face outputs (dicts, sequences, tensors) are equal: tensors within atol/rtol, the rest by ==."""
    if isinstance(out1, dict) and isinstance(out2, dict):
        assert set(out1) == set(out2), f"{track_name}: keys {sorted(out1)} vs {sorted(out2)}"
        for key in out1:
            if ignore_keys is None or key not in ignore_keys:
                assert_hf_output_close(out1[key], out2[key], ignore_keys, f"{track_name}.{key}", atol, rtol)
    elif isinstance(out1, (list, tuple)) and isinstance(out2, (list, tuple)):
        assert len(out1) == len(out2), f"{track_name}: length {len(out1)} vs {len(out2)}"
        for i, (a, b) in enumerate(zip(out1, out2)):
            assert_hf_output_close(a, b, ignore_keys, f"{track_name}.{i}", atol, rtol)
    elif isinstance(out1, Tensor) and isinstance(out2, Tensor):
        if out1.shape != out2.shape:
            raise AssertionError(f"{track_name}: shape mismatch: {out1.shape} vs {out2.shape}")
        assert_close(out1, out2, atol=atol, rtol=rtol)
    else:
        assert out1 == out2, f"{track_name}: value mismatch.\nout1: {out1}\nout2: {out2}"
