"""LoRA through peft: `Booster.enable_lora` wraps a model with adapters before `boost`; `boost` takes the PeftModel
and shards the transformers model inside it (shardformer/lora.py shards each adapter with its base layer), and
records, on the unsharded model, which parameters `save_lora_as_pretrained` writes under which keys (peft decides
that: its `get_peft_model_state_dict`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from torch import nn

__all__ = ["LoRAState", "enable_lora", "split_peft_model", "materialize_adapters", "adapter_file_keys",
           "checkpoint_key"]

# {adapter name: {key in its adapter file: parameter name in the transformers model}}
AdapterKeys = Dict[str, Dict[str, str]]


@dataclass
class LoRAState:
    """What a boosted LoRA model keeps (`HybridParallelModule.lora`): the PeftModel around the sharded transformers
    model, and each adapter's file keys and parameters (decided on the unsharded model)."""
    peft_model: nn.Module
    adapter_keys: AdapterKeys


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA needs the peft library: pip install peft (or this package's `lora` extra).") from None
    return peft


def enable_lora(model: nn.Module, pretrained_dir: Optional[str] = None, lora_config=None,
                bnb_quantization_config=None, quantize: bool = False):
    """The peft model with LoRA adapters on `model` (the transformers model, not yet boosted: Booster.enable_lora
    refuses a boosted one); refuses what boost cannot train."""
    peft = _peft()
    if isinstance(model, peft.PeftModel):
        raise ValueError("enable_lora got a model that already has peft adapters; pass the transformers model (add "
                         "more adapters with peft's add_adapter before boost).")
    if quantize or bnb_quantization_config is not None:
        raise NotImplementedError("Quantized LoRA (bnb_quantization_config / quantize=True, bitsandbytes) is not "
                                  "supported; train the adapters on the model in fp32 or bf16 (precision='bf16').")
    if pretrained_dir is None and lora_config is None:
        raise ValueError("enable_lora needs lora_config=peft.LoraConfig(...) for new adapters, or pretrained_dir= "
                         "for an adapter saved before.")
    if pretrained_dir is None and not isinstance(lora_config, peft.LoraConfig):
        raise TypeError(f"lora_config must be a peft.LoraConfig, got {type(lora_config).__name__}.")
    if pretrained_dir is not None:
        return peft.PeftModel.from_pretrained(model, pretrained_dir, is_trainable=True)
    return peft.get_peft_model(model, lora_config)


def split_peft_model(model: nn.Module) -> Tuple[nn.Module, Optional[nn.Module]]:
    """(the transformers model to shard, the PeftModel wrapping it or None). Only LoRA adapters are accepted."""
    try:
        from peft import PeftModel
    except ImportError:
        return model, None
    if not isinstance(model, PeftModel):
        return model, None
    kinds = sorted({str(getattr(c.peft_type, "value", c.peft_type)) for c in model.peft_config.values()})
    if kinds != ["LORA"]:
        raise NotImplementedError(f"boost supports peft's LoRA adapters only; this PeftModel has {kinds}.")
    return model.get_base_model(), model


def materialize_adapters(peft_model: nn.Module) -> None:
    """Adapters of a model built on the meta device (LazyInitContext) get real tensors and peft's own initialization
    (they are small): at boost only the base weights are materialized per rank, and `load_model` of the base
    model's checkpoint then leaves the adapters as they are."""
    from peft.tuners.lora import LoraLayer

    for layer in peft_model.modules():
        if not isinstance(layer, LoraLayer):
            continue
        for adapter in layer.lora_A:
            modules = (layer.lora_A[adapter], layer.lora_B[adapter])
            if not any(p.is_meta for m in modules for p in m.parameters()):
                continue
            init = peft_model.peft_config[adapter].init_lora_weights
            if not (init is True or init is False or init == "gaussian") or adapter in layer.lora_variant:
                raise ValueError(f"LoRA on a model built on the meta device: adapter {adapter!r} (init_lora_weights="
                                 f"{init!r}, variants {sorted(layer.lora_variant)}) needs the base weights to "
                                 f"initialize; use plain LoRA with init_lora_weights True, False or 'gaussian', or "
                                 f"build the model with its weights.")
            for module in modules:  # as peft builds them: nn.Linear's init, then its own
                module.to_empty(device="cpu")
                module.reset_parameters()
            layer.reset_lora_parameters(adapter, init)


def adapter_file_keys(peft_model: nn.Module) -> AdapterKeys:
    """For each adapter, the keys peft's `save_pretrained` writes and the parameter each holds; computed on the
    unsharded model (a pipeline stage later holds only its own layers)."""
    from peft import get_peft_model_state_dict

    hf = peft_model.get_base_model()
    name_of = {}
    for name, p in hf.named_parameters(remove_duplicate=False):
        name_of.setdefault(id(p), name)
    state = peft_model.state_dict(keep_vars=True)  # the parameters themselves: peft's selection keeps identities
    keys: AdapterKeys = {}
    for adapter in peft_model.peft_config:
        selected = get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=adapter)
        keys[adapter] = {}
        for key, value in selected.items():
            if id(value) not in name_of:
                raise NotImplementedError(f"adapter {adapter!r} saves {key!r}, which is not a parameter of the model; "
                                          f"save_lora_as_pretrained supports adapters made of parameters only.")
            keys[adapter][key] = name_of[id(value)]
    return keys


def checkpoint_key(name: str) -> str:
    """The key `save_model` writes a parameter of a LoRA model under: the wrapped module's own name for a LoRA
    layer's base weights (as ColossalAI saves them: the base model's `from_pretrained` reads them), peft's names for
    the adapters."""
    return name.replace(".base_layer.", ".")
