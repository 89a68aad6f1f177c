"""A small twin of a transformers model: the same class at tiny sizes with every other setting of its config (so the
same modules, flags and code paths), a synthetic batch for it, and a trace of the modules its forward calls, in order.
Plan inference reads a model's structure from its twin's trace (policies/inferred.py); the proof runs the twin sharded
and whole (prove.py).

Sizes are shrunk from the config's own values, not from per-family names: the head count to a few heads per tp rank
(keeping the query heads per key/value head), the head dim to 8 (rotary dims in proportion), every integer equal to
the hidden size to the twin's, other feature sizes (`ffn_dim`, `n_inner`, ...) in proportion, vocabularies to 100,
positions to 64, layer counts to the twin's, per-layer lists to their first entries; dropout probabilities to 0; a
vision model's images to 2 x 2 patches."""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ..image_batches import image_batch

__all__ = ["TWIN_VOCAB", "twin_config", "build_twin", "synthetic_batch", "Call", "trace_calls"]

TWIN_VOCAB, TWIN_HEAD_DIM, TWIN_POSITIONS = 100, 8, 64
SEQ, BATCH = 8, 2
TWIN_MAX_PARAMETERS = 20_000_000
_KV_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
_SIZE_WORDS = ("size", "dim", "inner", "ffn", "intermediate", "embd", "width", "d_model", "d_ff")


def _int(config, key: str) -> Optional[int]:
    try:
        value = getattr(config, key)
    except (AttributeError, RuntimeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def twin_config(config, tp: int = 1, layers: int = 2):
    """`config` at tiny sizes (module docstring): `layers` layers, heads split evenly over `tp` ranks."""
    hidden, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    if hidden is None or heads is None:
        raise ValueError(f"{type(config).__name__} has no integer hidden_size / num_attention_heads to shrink.")
    kv = next((v for v in (_int(config, k) for k in _KV_KEYS) if v is not None), heads)
    kv = kv if heads % kv == 0 else heads
    head_dim = _int(config, "head_dim") or hidden // heads
    kv_t = 2 * tp if kv == heads else (tp if kv % tp == 0 else kv)  # (fewer kv heads than ranks: kept so)
    heads_t, head_dim_t = kv_t * (heads // kv), min(TWIN_HEAD_DIM, head_dim)
    hidden_t = heads_t * head_dim_t if hidden == heads * head_dim else \
        max(2 * tp, hidden * heads_t * head_dim_t // (heads * head_dim))
    n_layers = _int(config, "num_hidden_layers")
    values = config.to_dict()
    changed: Dict[str, Any] = {"use_cache": False}
    for key, value in values.items():
        k = key.lower()
        if isinstance(value, float) and ("dropout" in k or k.endswith("pdrop")):
            changed[key] = 0.0
        elif isinstance(value, (list, tuple)) and n_layers and len(value) == n_layers and layers <= n_layers:
            changed[key] = type(value)(value[:layers])  # per-layer settings: the first layers'
        elif isinstance(value, int) and not isinstance(value, bool) and value > 0:
            new = _shrunk(k, value, dict(hidden=(hidden, hidden_t), heads=(heads, heads_t), kv=(kv, kv_t),
                                         head_dim=(head_dim, head_dim_t), layers=layers, tp=tp))
            if new != value:
                changed[key] = new
    patch = _int(config, "patch_size")
    if patch is not None and _int(config, "image_size") is not None:  # a vision model: 2 x 2 patches
        changed["image_size"] = 2 * patch
    twin = type(config)(**{**values, **changed})
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is not None:  # the same attention code path as the model
        try:
            twin._attn_implementation = implementation
        except (AttributeError, ValueError):
            pass
    return twin


def _shrunk(k: str, value: int, s: Dict[str, Any]) -> int:
    """The twin's value of the integer config entry `k` (lower-cased)."""
    (hidden, hidden_t), (head_dim, head_dim_t) = s["hidden"], s["head_dim"]
    if k.endswith("layers") or k in ("n_layer", "num_layers"):
        return s["layers"]
    if k.startswith("vocab_size"):
        return TWIN_VOCAB
    if k.endswith("token_id"):
        return value if value < TWIN_VOCAB else TWIN_VOCAB - 1
    if "position" in k or k in ("n_positions", "n_ctx", "seq_length", "max_seq_len"):
        return min(value, TWIN_POSITIONS)
    if "rotary" in k and "dim" in k:
        return max(2, value * head_dim_t // head_dim // 2 * 2)
    if "head" in k and ("dim" in k or "size" in k):
        return head_dim_t if value == head_dim else max(1, value * head_dim_t // head_dim)
    if "head" in k:
        return s["heads"][1] if value == s["heads"][0] else s["kv"][1] if value == s["kv"][0] else value
    if value == hidden:
        return hidden_t
    if value > hidden_t and any(w in k for w in _SIZE_WORDS):  # feature sizes in proportion, split evenly
        step = 2 * s["tp"]
        return max(step, (value * hidden_t // hidden + step - 1) // step * step)
    return value


def build_twin(model: nn.Module, tp: int = 1, layers: int = 2, seed: int = 0) -> nn.Module:
    """A fresh twin of `model` (module docstring), fp32 on the CPU, in training mode; the global RNG is left as it
    was (the twin is initialized from `seed`)."""
    config = twin_config(model.config, tp, layers)
    with torch.device("meta"):  # sized first: a size this shrinking does not know would leave it large
        size = sum(p.numel() for p in type(model)(config).parameters())
    if size > TWIN_MAX_PARAMETERS:
        raise ValueError(f"its twin would still have {size} parameters: some size of {type(config).__name__} is "
                         f"not one this shrinking knows.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        twin = type(model)(config).float()
    return twin.train()


def synthetic_batch(model: nn.Module, seed: int = 0, device: Optional[torch.device] = None) -> Dict[str, torch.Tensor]:
    """Token ids (a right-padded sample), their mask, and the labels the model's head takes (causal / masked LM,
    sequence or token classification, question answering spans); none for other heads. A vision model (its forward
    takes pixel_values, not input_ids): images (image_batch)."""
    config, name = model.config, type(model).__name__
    g = torch.Generator().manual_seed(seed)
    if "input_ids" not in inspect.signature(model.forward).parameters:
        batch = image_batch(model, BATCH, g)
        return {k: v.to(device) for k, v in batch.items()} if device is not None else batch
    ids = torch.randint(3, TWIN_VOCAB - 1, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    ids[0, -2:] = config.pad_token_id if isinstance(config.pad_token_id, int) else 0
    batch = {"input_ids": ids, "attention_mask": mask}
    accepts = inspect.signature(model.forward).parameters
    labels = max(1, getattr(config, "num_labels", 2) or 2)
    if "labels" in accepts:
        if "SequenceClassification" in name:
            batch["labels"] = torch.randint(0, labels, (BATCH,), generator=g) if labels > 1 else \
                torch.randn(BATCH, generator=g)
        elif "TokenClassification" in name:
            batch["labels"] = torch.randint(0, labels, (BATCH, SEQ), generator=g).masked_fill(mask == 0, -100)
        elif model.get_output_embeddings() is not None:
            batch["labels"] = ids.masked_fill(mask == 0, -100)
    if "start_positions" in accepts and "end_positions" in accepts:
        batch["start_positions"] = torch.randint(0, SEQ, (BATCH,), generator=g)
        batch["end_positions"] = torch.randint(0, SEQ, (BATCH,), generator=g)
    return {k: v.to(device) for k, v in batch.items()} if device is not None else batch


class Call(NamedTuple):
    """One module call of a traced forward: its path, whether it starts or ends, (at the start) its first tensor
    input's identity, whether its first positional argument is an integer tensor (ids, a mask), and the names and
    shapes of its tensor arguments; (at the end) the shape of its first tensor output."""
    path: str
    start: bool
    input_id: Optional[int] = None
    integer_input: bool = False
    tensors: Tuple[Tuple[str, Tuple[int, ...]], ...] = ()
    output_shape: Optional[Tuple[int, ...]] = None


def _tensor_arguments(module: nn.Module, args, kwargs) -> List[Tuple[str, torch.Tensor]]:
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        names = []
    named = [(names[i] if i < len(names) else str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
    return [(name, value) for name, value in named if isinstance(value, torch.Tensor)]


def trace_calls(model: nn.Module, batch: Dict[str, torch.Tensor]) -> List[Call]:
    """The module calls of one forward of `model` on `batch` (no gradients), in order."""
    calls: List[Call] = []
    alive: List[torch.Tensor] = []  # inputs kept alive, so that their ids are not reused during the trace

    def pre(path, module, args, kwargs):
        tensors = _tensor_arguments(module, args, kwargs)
        x = tensors[0][1] if tensors else None
        alive.extend(t for _, t in tensors)
        first = args[0] if args else next(iter(kwargs.values()), None)
        calls.append(Call(path, True, id(x) if x is not None else None,
                          isinstance(first, torch.Tensor) and not first.is_floating_point(),
                          tuple((name, tuple(t.shape)) for name, t in tensors)))

    def post(path, module, args, output):
        values = output if isinstance(output, (tuple, list)) else (output,)
        first = next((v for v in values if isinstance(v, torch.Tensor)), None)
        calls.append(Call(path, False, output_shape=tuple(first.shape) if first is not None else None))

    handles = []
    for path, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, k, p=path: pre(p, m, a, k), with_kwargs=True))
        handles.append(module.register_forward_hook(lambda m, a, o, p=path: post(p, m, a, o)))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return calls
