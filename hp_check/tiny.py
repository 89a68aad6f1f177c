"""Tiny configs for any transformers family: its own defaults with small sizes, built through the config's
constructor so that derived fields (layer_types, head_dim, sliding patterns) follow.

What is resized, from the defaults' own structure (no per-family code):
- the TINY sizes the config has attributes for; every dropout and router jitter to 0;
- other vocabularies (`vocab_size*`), hidden sizes (`hidden_size*`, scaled like hidden_size) and feed-forward
  sizes (`*intermediate_size`, `*ffn_hidden_size`: experts');
- per-layer lists (as long as the default layer count: `layer_types`, sparsity patterns) take the family's distinct
  values in turn over the new layer count; counts of special layers (`num_kv_shared_layers`) scale with it;
- multi-head latent attention (a `*lora_rank`): its dims (`*_head_dim`) scale like `head_dim`, its low ranks
  shrink, and it has as many key/value heads as query heads;
- RoPE given per layer type but empty by default gets the default RoPE for each type;
- a heterogeneous config's per-layer attributes (e.g. a larger head_dim on full-attention layers) follow their
  layer's kind and are scaled like their global value;
- an encoder-decoder's other stack (`encoder_*` / `decoder_*` layers, heads, feed-forward sizes), its source and
  target positions, and its decoder start token (the padding token where the config has none);
- sub-configs (a vision or audio encoder the text model carries) get small sizes too, when they accept them.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict

VOCAB = 100
TINY: Dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
    "sliding_window": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "use_cache": False,
    "rotary_dim": 4,  # partial rotary (GPT-J, CodeGen): at most head_dim
}
# counts of layers of a special kind, scaled with the layer count (rounded, at least 1 when the default has some)
LAYER_COUNTS = ("num_kv_shared_layers",)
# an encoder-decoder's position counts, as small as max_position_embeddings (a speech encoder's input frames: twice)
POSITIONS = ("max_source_positions", "max_target_positions")


def tiny_config(config_class, **overrides):
    """`config_class` with the TINY sizes it has attributes for, every dropout / jitter at 0, then `overrides`."""
    defaults = config_class()
    kwargs = {k: v for k, v in TINY.items() if _has(defaults, k) and not _read_only(config_class, k)}
    mla = any(k.endswith("lora_rank") for k in vars(defaults))
    if mla and "num_key_value_heads" in kwargs:  # latent attention expands its keys/values to every head
        kwargs["num_key_value_heads"] = TINY["num_attention_heads"]
    for key, value in vars(defaults).items():
        if isinstance(value, float) and not isinstance(value, bool) and \
                ("dropout" in key or "jitter" in key or key.endswith("pdrop")):  # (training-time randomness)
            kwargs[key] = 0.0
    n_default = _value(defaults, "num_hidden_layers")
    n = overrides.get("num_hidden_layers", kwargs.get("num_hidden_layers", n_default))
    for key, value in vars(defaults).items():
        if key in kwargs or not isinstance(n_default, int) or n_default <= 0:
            continue
        if isinstance(value, (list, tuple)) and (len(value) == n_default or key == "layer_types") and value and \
                all(isinstance(v, (str, int, float)) for v in value):  # per-layer values: the kinds in turn
            kinds = list(dict.fromkeys(value))
            kwargs[key] = [kinds[i % len(kinds)] for i in range(n)]
        elif key in LAYER_COUNTS and isinstance(value, int) and value > 0:
            kwargs[key] = max(1, round(value * n / n_default))
    hidden = _value(defaults, "hidden_size")
    for key, value in vars(defaults).items():  # other vocabularies and sizes (per-layer embeddings, experts)
        if key in kwargs or isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            continue
        if key.startswith("vocab_size"):
            kwargs[key] = VOCAB
        elif key.endswith(("intermediate_size", "ffn_hidden_size")) and value > TINY["intermediate_size"]:
            kwargs[key] = TINY["intermediate_size"]  # (experts', shared experts')
        elif key.startswith(("encoder_", "decoder_")) and key.endswith("_attention_heads"):
            kwargs[key] = TINY["num_attention_heads"]
        elif key.startswith(("encoder_", "decoder_")) and key.endswith("_ffn_dim"):
            kwargs[key] = TINY["intermediate_size"]
        elif key.startswith(("encoder_", "decoder_")) and key.endswith("_layers") and value == n_default:
            kwargs[key] = n  # (an encoder-decoder's other stack, as deep as the one num_hidden_layers names)
        elif key == "decoder_start_token_id" and value >= VOCAB:  # (a speech decoder's start token)
            kwargs[key] = TINY["bos_token_id"]
        elif key in POSITIONS and value > TINY["max_position_embeddings"]:
            kwargs[key] = TINY["max_position_embeddings"]
        elif key.startswith("hidden_size") and isinstance(hidden, int) and hidden > 0:
            kwargs[key] = max(4, value * TINY["hidden_size"] // hidden)
    head_dim = _value(defaults, "head_dim")
    for key, value in vars(defaults).items() if mla else ():  # latent attention's dims, scaled like head_dim
        if key in kwargs or isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            continue
        if key.endswith("_head_dim") and isinstance(head_dim, int) and head_dim > 0:
            kwargs[key] = max(2, value * TINY["head_dim"] // head_dim)
        elif key.endswith("lora_rank") and value > 16:
            kwargs[key] = 16
    if getattr(defaults, "is_encoder_decoder", False) and not _has(defaults, "decoder_start_token_id"):
        kwargs["decoder_start_token_id"] = TINY["pad_token_id"]  # (T5's decoder starts at its padding token)
    rope = _value(defaults, "rope_parameters")
    if rope == {} and isinstance(kwargs.get("layer_types"), list):  # per layer type, none by default
        kwargs["rope_parameters"] = {kind: {"rope_type": "default", "rope_theta": 10000.0}
                                     for kind in dict.fromkeys(kwargs["layer_types"])}
    per_layer = _per_layer_overrides(defaults, kwargs, n)
    if per_layer:
        kwargs["per_layer_config"] = per_layer
    for key, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if key not in overrides and isinstance(sub_class, type):
            sub = _tiny_sub_config(sub_class)
            if sub is not None:
                kwargs[key] = sub
    kwargs.update(overrides)
    config = config_class(**kwargs)
    if not _has(config, "classifier_dropout"):  # a head reading it falls back to 0.1 (GPT-2's token classifier)
        try:
            config.classifier_dropout = 0.0
        except Exception:  # noqa: BLE001  (a config that takes no new attributes: its heads do not read it)
            pass
    return config


_MISSING = object()


def _value(config, key: str, default=None):
    """config.key; a heterogeneous config's per-layer attribute reads its global value (no error)."""
    try:
        return getattr(config, key)
    except AttributeError:
        return default
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError
        return vars(config).get(key, default)


def _has(config, key: str) -> bool:
    return _value(config, key, _MISSING) is not _MISSING


def _read_only(config_class, key: str) -> bool:
    """A property the config derives and cannot be given (Falcon's head_dim)."""
    attr = getattr(config_class, key, None)
    return isinstance(attr, property) and attr.fset is None


def _per_layer_overrides(defaults, kwargs: Dict[str, Any], n: int) -> Dict[int, Dict[str, Any]]:
    """A heterogeneous config's per-layer attributes for the tiny layers: each takes those of the first default
    layer of its kind (`layer_types`; else the layer of its index), sizes scaled as their global value was."""
    spec = vars(defaults).get("_heterogeneity_spec")
    if spec is None:
        return {}
    kinds, tiny_kinds = vars(defaults).get("layer_types"), kwargs.get("layer_types")
    out: Dict[int, Dict[str, Any]] = {}
    for i in range(n):
        source = kinds.index(tiny_kinds[i]) if kinds and tiny_kinds and tiny_kinds[i] in kinds else i
        overrides = {}
        for key, value in spec.per_layer_overrides.get(source, {}).items():
            base = vars(defaults).get(key)
            if key in kwargs and isinstance(value, int) and isinstance(base, int) and base > 0 and \
                    isinstance(kwargs[key], int):
                value = max(1, value * kwargs[key] // base)
            overrides[key] = value
        if overrides:
            out[i] = overrides
    return out


def _tiny_sub_config(config_class):
    """A sub-config (encoder of another modality) with small sizes, or None when it rejects them."""
    try:
        defaults = config_class()
    except Exception:  # noqa: BLE001  (a sub-config without usable defaults: left to its parent)
        return None
    kwargs = {k: v for k, v in TINY.items() if hasattr(defaults, k) and not k.endswith(("token_id", "vocab_size"))}
    for key, value in vars(defaults).items():
        if isinstance(value, bool) or not isinstance(value, int) or key in kwargs:
            continue
        if key.endswith(("layers", "blocks", "depth")) and value > 2:
            kwargs[key] = 2
        elif ("channel" in key or key.endswith(("_size", "_dim"))) and value >= 256:
            kwargs[key] = 32
    try:
        return config_class(**kwargs)
    except Exception:  # noqa: BLE001
        return None


def model_class(name: str):
    """A transformers model class by name ('Qwen3ForCausalLM') or dotted path ('pkg.module:Class')."""
    if ":" in name:
        module, _, attr = name.partition(":")
        return getattr(importlib.import_module(module), attr)
    import transformers
    if not hasattr(transformers, name):
        raise ValueError(f"transformers has no class {name!r}; give a model class name such as Qwen3ForCausalLM, "
                         f"or module:Class.")
    return getattr(transformers, name)
