"""Tiny configs for any transformers family: its own defaults with small sizes, built through the config's
constructor so that derived fields (layer_types, head_dim, sliding patterns) follow."""
from __future__ import annotations

import importlib
from typing import Any, Dict

VOCAB = 100
TINY: Dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
    "sliding_window": 4, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "use_cache": False,
}


def tiny_config(config_class, **overrides):
    """`config_class` with the TINY sizes it has attributes for, every dropout at 0, then `overrides`."""
    defaults = config_class()
    kwargs = {k: v for k, v in TINY.items() if hasattr(defaults, k)}
    for key, value in vars(defaults).items():
        if isinstance(value, float) and not isinstance(value, bool) and ("dropout" in key or key.endswith("pdrop")):
            kwargs[key] = 0.0
    types = getattr(defaults, "layer_types", None)
    if isinstance(types, (list, tuple)) and types:  # the family's kinds, alternating over the new layer count
        kinds = list(dict.fromkeys(types))
        n = overrides.get("num_hidden_layers", kwargs.get("num_hidden_layers", len(types)))
        kwargs["layer_types"] = [kinds[i % len(kinds)] for i in range(n)]
    kwargs.update(overrides)
    return config_class(**kwargs)


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
