"""A direct call of a pipeline-parallel model, made alike by every rank of the pipeline (SPMD, as torch users call a
tp model: `model(**batch)`, `model.unwrap()(**batch)`, each forward of `model.unwrap().generate(...)`), run as one
pipelined forward: every rank runs the model's own forward on its stage, and the call returns on every rank what one
process returns.

Nothing of the forward is copied; around the call (a forward pre-hook and an always-called forward hook on the
transformers model):
- a stage after the first receives the previous stage's hidden states before its forward, and its first layer takes
  them (StageForward.viewing, as in a schedule's call);
- a stage before the last sends its last layer's output on (a forward hook on that layer) and lets its forward go on:
  its exit modules (the final norm) are identities for the call and its head a stand-in that returns what the last
  stage's head returned, broadcast over the pp group (a forward hook on the last stage's head). What the model does
  after its head (soft-capping, the loss from `labels`) each rank then does itself, on the same values;
- a mixture-of-experts model's router logits travel with the hidden states (expert/router_logits.py), so the last
  stage's load-balancing loss is one process's; its `loss`, `aux_loss` and `router_logits` then reach every stage;
- the cache: each stage fills its own layers' entries of a `StageCache` (stage_cache.py), which answers length queries
  about the other stages' layers; `generate` keeps the cache a forward returns, so its steps run on it.
The call runs without gradients (an evaluation forward: the schedule alone runs backward passes through stages).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, ContextManager, Dict, List, Optional

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from pipeline.stage_link import StageLink

from ..expert.router_logits import ROUTER_LOGITS
from .forward import Released, StageForward, get_submodule_parent, replace_submodule, stage_output
from .stage_cache import StageCache

__all__ = ["PipelinedCall"]

CACHE_NAMES = ("cache", "past_key_values")  # the cache keyword, and its earlier name (transformers 5.17)
ASKED_OUTPUTS = ("output_hidden_states", "output_attentions")
# fields of a mixture-of-experts output that depend on every layer's router logits (expert/router_logits.py): the
# last stage's, whose forward saw them all
ROUTING_FIELDS = ("loss", "aux_loss", "router_logits")


def _released(model: nn.Module, path: str) -> bool:
    """Whether the module at `path` is released on this stage (False where the model has none there)."""
    try:
        return isinstance(getattr(*get_submodule_parent(model, path), None), Released)
    except AttributeError:  # (its parent is absent)
        return False


class FromLastStage(nn.Module):
    """Stands in for a head on a stage before the last during a pipelined call: returns what the last stage's head
    returned for this call."""

    def __init__(self, link: StageLink) -> None:
        super().__init__()
        self.link = link

    def forward(self, *args, **kwargs) -> Any:
        return self.link.from_last(None)


class PipelinedCall:
    """Runs a direct call of `stage_forward.model` on this rank as its part of one pipelined forward (see the module
    docstring). `exits`: model-relative paths of the exit modules; `heads`: of the heads (the last stage's)."""

    def __init__(self, stage_forward: StageForward, exits: List[str], heads: List[str], link: StageLink,
                 full_logits: Optional[Callable[[], ContextManager[None]]] = None) -> None:
        self.stage_forward, self.link = stage_forward, link
        self.full_logits = full_logits  # a causal-LM loss computed in chunks: its switch to the full logits
        sm = link.stage_manager
        self.first, self.last = sm.is_first_stage(), sm.is_last_stage()
        self.held = stage_forward.layers.indices()
        model = stage_forward.model
        params = inspect.signature(model.forward).parameters
        self._cache_name = next((name for name in CACHE_NAMES if name in params), None)  # (None: it takes none)
        self._stand_ins: Dict[str, nn.Module] = {}
        if not self.last:  # (the exit modules this model has: optional ones may be None)
            self._stand_ins = {path: nn.Identity() for path in exits if _released(model, path)}
            self._stand_ins.update({name: FromLastStage(link) for name in heads if _released(model, name)})
        self._running: Optional[contextlib.ExitStack] = None
        view = stage_forward.chunks[0]
        if not self.last and view.exit_layer is not None:
            view.exit_layer.register_forward_hook(self._send_on)
        if self.last:
            for name in heads:
                model.get_submodule(name).register_forward_hook(self._broadcast_head)

    @property
    def running(self) -> bool:
        return self._running is not None

    def refusal(self, kwargs: Dict[str, Any]) -> Optional[str]:
        """Why this call cannot run pipelined (the same on every rank: it reads the layout and the arguments only),
        naming the fix; None if it can."""
        sf = self.stage_forward
        if len(sf.chunks) > 1:
            return ("this rank holds several model chunks (an interleaved or V schedule), so one forward would pass "
                    "through each rank several times. Boost with one chunk per rank (pp_style='1f1b', "
                    "num_model_chunks=1) to call or generate under pipeline parallelism")
        if sf.first_stage_inputs:
            return (f"{type(sf.model).__name__} takes inputs only its first stage reads "
                    f"({', '.join(sf.first_stage_inputs)}: a multimodal model); direct calls under pipeline "
                    f"parallelism run text-only decoder models")
        config = sf.loop.config
        asked = [k for k in ASKED_OUTPUTS if (kwargs[k] if kwargs.get(k) is not None else getattr(config, k, False))]
        if asked:
            return (f"{', '.join(asked)}=True asks for every layer's outputs, which each stage holds for its own "
                    f"layers only; call without it")
        cache = next((kwargs[k] for k in CACHE_NAMES if kwargs.get(k) is not None), None)
        if cache is not None and type(cache) not in (DynamicCache, StageCache):
            return (f"the cache is a {type(cache).__name__}; under pipeline parallelism each stage fills its own "
                    f"layers' entries of a DynamicCache (the default: pass none, or cache_implementation='dynamic')")
        return None

    def begin(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """Before the model's forward: this stage's view, the previous stage's hidden states, the stand-ins; returns
        the call's arguments (the cache this stage fills in place of the one given)."""
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(torch.no_grad())
            if self.full_logits is not None:
                stack.enter_context(self.full_logits())
            received = self.link.receive() if not self.first else {}
            stack.enter_context(self.stage_forward.viewing(0, received.get("hidden_states"),
                                                           received.get(ROUTER_LOGITS)))
            stack.enter_context(self._stand_ins_in_place())
        except BaseException:
            stack.close()
            raise
        self._running = stack
        return self._with_stage_cache(kwargs)

    def end(self, output: Any) -> Any:
        """After the model's forward (`output` None: it raised): everything back as it was, the sends completed;
        returns the call's output (a mixture-of-experts model's loss and router logits: the last stage's)."""
        stack, self._running = self._running, None
        try:
            if output is not None and getattr(output, "router_logits", None) is not None:
                output = self._routing_from_last(output)
        finally:
            stack.close()
            self.link.finish()
        return output

    def _routing_from_last(self, output: Any) -> Any:
        mine = {k: output[k] for k in ROUTING_FIELDS if output.get(k) is not None} if self.last else None
        for key, value in self.link.from_last(mine).items():
            output[key] = value
        return output

    def _with_stage_cache(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        name = next((k for k in CACHE_NAMES if kwargs.get(k) is not None), None)
        if name is not None:
            cache = kwargs[name]
            if not isinstance(cache, StageCache):
                kwargs = {**kwargs, name: StageCache.adopt(cache, self.held)}
            return kwargs
        model = self.stage_forward.model
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self.stage_forward.loop.config, "use_cache", False)
        if not use_cache or not model.can_generate() or self._cache_name is None:  # (an encoder's config may say
            return kwargs                                                           # use_cache: it uses none)
        # the cache the model would make itself, from its whole config (a stage's view holds its layers' types only)
        return {**kwargs, self._cache_name: StageCache(self.held, config=model.config)}

    @contextlib.contextmanager
    def _stand_ins_in_place(self):
        model = self.stage_forward.model
        restore = {path: model.get_submodule(path) for path in self._stand_ins}
        for path, module in self._stand_ins.items():
            replace_submodule(model, path, module)
        try:
            yield
        finally:
            for path, module in restore.items():
                replace_submodule(model, path, module)

    @torch.compiler.disable  # eager after a compiled layer (regional compilation), as StageForward's exit hook
    def _send_on(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.running:
            self.link.send(stage_output(output))

    def _broadcast_head(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.running:
            self.link.from_last(output)
