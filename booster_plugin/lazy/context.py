"""LazyInitContext, as ColossalAI scripts use it (`colossalai.lazy.LazyInitContext`):

    with LazyInitContext(default_device=get_accelerator().get_current_device()):
        model = AutoModelForCausalLM.from_pretrained(path)    # or Model(config), AutoModel...from_config(config)
    model, optimizer, *_ = booster.boost(model, optimizer)    # each rank reads / initializes its own shard only

Inside, every tensor is built on the meta device (no memory). `from_pretrained` keeps its semantics (config, dtype,
tied weights, missing keys initialized, `eval()`) but remembers where each weight comes from instead of reading it
(pretrained.py). A model built from a config is initialized as eager init would (record.py): its init is recorded,
random draws included, and the script's RNG is left where eager init leaves it. `boost` materializes this rank's
shard of each tensor (shardformer/materialize.py): read from the safetensors slices it covers, or eager init's
values, drawn again one full tensor at a time (the same weights on every layout as in one process). Without a
plugin, `LazyInitContext.materialize(model)` materializes the whole model.
"""
from __future__ import annotations

import contextlib
import functools
from itertools import chain
from typing import Any, ClassVar, Iterator, Optional, Union

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from pipeline.context import Axis
from shardformer.lazy_sources import lazy_device_of, set_lazy_device
from shardformer.layer.tensor_registry import unregistered
from shardformer.materialize import materialize as materialize_shard

from ..dist_logger import get_dist_logger
from .pretrained import lazy_loading
from .record import Recorder, recording

__all__ = ["LazyInitContext"]


class LazyInitContext:
    """Build models without allocating their weights (see the module docstring).

    Args:
        tensor_cls: accepted for compatibility (ColossalAI's is a test-only switch of its lazy tensor class).
        default_device: where `LazyInitContext.materialize` puts the tensors built inside (ColossalAI's meaning;
            default the CPU). `boost` materializes on the plugin's device whatever it is.
        per_rank_init: a model built from a config is not recorded; `boost` initializes each rank's shard with the
            model's `_init_weights`, drawn per pipeline stage and tp rank. Faster (no draws at construction, each
            rank draws its shard only), but the weights then differ from eager init's, and between layouts; the
            script's RNG is not advanced by the construction. Default False: eager init's weights.
    """

    _active: ClassVar[bool] = False

    def __init__(self, tensor_cls: Optional[type] = None,
                 default_device: Optional[Union[torch.device, str, int]] = None, *,
                 per_rank_init: bool = False) -> None:
        self.tensor_cls = tensor_cls
        self.default_device = torch.device(default_device) if default_device is not None else None
        self.per_rank_init = per_rank_init
        self._stack: Optional[contextlib.ExitStack] = None

    def __enter__(self) -> "LazyInitContext":
        if LazyInitContext._active:
            raise RuntimeError("LazyInitContext is not reentrant")
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.device("meta"))
            recorder = None if self.per_rank_init else stack.enter_context(recording())
            stack.enter_context(_lazy_from_pretrained(self.default_device, recorder))
            if self.default_device is not None:
                stack.enter_context(_tagging(self.default_device))
            self._stack = stack.pop_all()
        LazyInitContext._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        LazyInitContext._active = False
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    @staticmethod
    def materialize(module: nn.Module, verbose: bool = False) -> nn.Module:
        """Materialize every meta tensor of `module` in place on one device (the context's `default_device`, else
        the CPU): checkpoint tensors of a lazy `from_pretrained` are read, the others initialized by the model's own
        init. Returns `module`. `verbose`: rank 0 logs how much of the model was lazy (ColossalAI's report)."""
        lazy = [t for t in chain(module.parameters(), module.buffers()) if t.is_meta]
        device = next((d for d in map(lazy_device_of, lazy) if d is not None), torch.device("cpu"))
        if verbose:
            _report(module)
        _materialize_in_place(module, device)
        return module


@contextlib.contextmanager
def _lazy_from_pretrained(device: Optional[torch.device], recorder: Optional[Recorder]) -> Iterator[None]:
    """`PreTrainedModel.from_pretrained` (every model class and Auto class reaches it) loads lazily meanwhile.
    transformers refuses `from_pretrained` under a meta device context, and builds the model on meta itself: the
    call runs under the CPU device context, unrecorded (as eager, it draws nothing for the weights it loads)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        yield
        return
    original = PreTrainedModel.__dict__["from_pretrained"]

    @functools.wraps(original.__func__)
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        with torch.device("cpu"), lazy_loading(), (recorder.pause() if recorder else contextlib.nullcontext()):
            loaded = original.__func__(cls, *args, **kwargs)
        if device is not None:  # the model, or (model, loading info) with output_loading_info=True
            _tag_tree(loaded[0] if isinstance(loaded, tuple) else loaded, device)
        return loaded

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original


@contextlib.contextmanager
def _tagging(device: torch.device) -> Iterator[None]:
    """Every meta parameter and buffer registered meanwhile remembers `device` (where `materialize` puts it)."""
    def tag(module: nn.Module, name: str, tensor: Optional[torch.Tensor]) -> None:
        if tensor is not None and tensor.is_meta:
            set_lazy_device(tensor, device)

    handles = [nn_module.register_module_parameter_registration_hook(tag),
               nn_module.register_module_buffer_registration_hook(tag)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _tag_tree(model: nn.Module, device: torch.device) -> None:
    for t in chain(model.parameters(), model.buffers()):
        if t.is_meta:
            set_lazy_device(t, device)


def _materialize_in_place(module: nn.Module, device: torch.device) -> None:
    """`materialize` keeping each tensor object (an optimizer built over the lazy parameters stays valid, as with
    ColossalAI's in-place materialization): the new tensors' contents are swapped into the meta ones."""
    slots = [(store, key, t) for m in module.modules() for store in (m._parameters, m._buffers)
             for key, t in store.items() if t is not None and t.is_meta]
    materialize_shard(module, device, Axis.alone("tp"), 0)
    swapped = set()
    for store, key, old in slots:
        if id(old) not in swapped:
            with unregistered(old, store[key]):
                torch.utils.swap_tensors(old, store[key])
            swapped.add(id(old))
        store[key] = old


def _report(module: nn.Module) -> None:
    params, buffers = list(module.parameters()), list(module.buffers())
    total = sum(t.numel() for t in params + buffers)
    eager = sum(t.numel() for t in params + buffers if not t.is_meta)
    logger = get_dist_logger()
    logger.info(f"Param lazy rate: {sum(p.is_meta for p in params)}/{len(params)}", ranks=[0])
    logger.info(f"Buffer lazy rate: {sum(b.is_meta for b in buffers)}/{len(buffers)}", ranks=[0])
    logger.info(f"Non lazy numel: {eager} ({eager / 1024 ** 2:.3f} M), ratio: {eager / max(total, 1) * 100}%",
                ranks=[0])
