"""What the coverage table covers: the model families (those whose config declares transformers plans, by kind, and
the families without plans that ColossalAI's shardformer covers or a hand-written policy serves) and, per family, one
row per model class transformers' auto mappings give it (every task head) or ColossalAI's policy list names."""
from __future__ import annotations

import os
from typing import Dict, List, NamedTuple, Optional, Tuple

MOE_STYLES = ("moe_tp_experts", "moe_identity_expert")
MOE_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
NO_PLANS = "no transformers plans"
KINDS = ("dense decoder", "MoE", "other", NO_PLANS)
COLOSSALAI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "colossalai_classes.txt")
# ColossalAI's remote-code classes (trust_remote_code models): the transformers class of the same architecture, if any
REMOTE = {
    "DeepseekV3ForCausalLM": "DeepseekV3ForCausalLM", "DeepseekV3Model": "DeepseekV3Model",
    "DeepseekForCausalLM": None, "DeepseekModel": None,
    "ChatGLMForConditionalGeneration": None, "ChatGLMModel": None,
}


class Family(NamedTuple):
    model_type: str
    model_class: str  # the class the (tp, pp) and ep columns have always tested: the causal LM, else the base model
    kind: str         # one of KINDS


class Row(NamedTuple):
    family: Family
    model_class: str  # a class name of transformers ("-": none)
    task: str         # the auto mappings it is in ("causal LM", "sequence classification", ...)


class ColossalClass(NamedTuple):
    path: str                  # as ColossalAI's policy list gives it
    name: str                  # the class name
    in_transformers: bool      # transformers 5 has a class of that path
    counted_as: Optional[str]  # the transformers class whose row stands for it (None: not in transformers 5)


def _mappings() -> List[Tuple[str, dict]]:
    """(task, {model_type: class name(s)}) of every auto mapping, the base model's last."""
    from transformers.models.auto import modeling_auto as ma
    names = sorted(n for n in dir(ma) if n.startswith("MODEL_FOR_") and n.endswith("_MAPPING_NAMES"))
    out = [(n[len("MODEL_FOR_"):-len("_MAPPING_NAMES")].lower().replace("_", " ").replace("lm", "LM"),
            getattr(ma, n)) for n in names]
    return out + [("base model", ma.MODEL_MAPPING_NAMES)]


def _classes(value) -> List[str]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def colossalai_classes() -> List[ColossalClass]:
    import transformers
    out = []
    with open(COLOSSALAI) as f:
        for path in (line.strip() for line in f if line.strip()):
            module, _, name = path.rpartition(".")
            cls = getattr(transformers, name, None) if module.startswith("transformers.models.") else None
            found = cls is not None and cls.__module__ == module
            out.append(ColossalClass(path, name, found, name if found else REMOTE.get(name)))
    return out


def families(only: List[str]) -> List[Family]:
    """Every family whose config declares plans (dense decoder / MoE / other), then the families without plans
    that ColossalAI's list names or a hand-written policy serves."""
    import transformers
    from transformers.models.auto import configuration_auto as ca, modeling_auto as ma
    from shardformer.policies.auto_policy import SUPPORTED_MODELS

    wanted = {c.counted_as for c in colossalai_classes() if c.counted_as} | set(SUPPORTED_MODELS)
    out = []
    for model_type in sorted(ca.CONFIG_MAPPING_NAMES):
        if only and model_type not in only:
            continue
        try:
            config_class = ca.CONFIG_MAPPING[model_type]
        except Exception:  # noqa: BLE001  (a family whose config cannot be imported here)
            continue
        causal = ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        name = _classes(causal or ma.MODEL_MAPPING_NAMES.get(model_type) or "-")[0]
        if not getattr(config_class, "base_model_tp_plan", None) and not getattr(config_class, "base_model_pp_plan",
                                                                                 None):
            own = getattr(transformers, name, None)  # (not an alias of another family's classes: gpt-sw3's GPT-2)
            if own is not None and own.__module__.split(".")[2] == ca.model_type_to_module_name(model_type) and \
                    any(c in wanted for _, m in _mappings() for c in _classes(m.get(model_type) or [])):
                out.append(Family(model_type, name, NO_PLANS))
            continue
        moe = _is_moe(config_class)
        if causal:  # the class tested may take another config (llama4's causal LM is the MoE llama4_text's)
            try:
                moe = moe or _is_moe(getattr(transformers, name).config_class)
            except Exception:  # noqa: BLE001  (a class that cannot be imported here: judged by its family's config)
                pass
        out.append(Family(model_type, name, "MoE" if moe else ("dense decoder" if causal else "other")))
    return out


def _is_moe(config_class) -> bool:
    try:
        defaults = config_class()
    except Exception:  # noqa: BLE001
        defaults = None
    tp_plan = getattr(config_class, "base_model_tp_plan", None) or {}
    return any(str(s) in MOE_STYLES for s in tp_plan.values()) or any(getattr(defaults, a, 0) for a in MOE_ATTRS)


def rows(families_: List[Family], colossal: List[ColossalClass]) -> List[Row]:
    """Per family: its tested class first, then every other class of its auto mappings and of ColossalAI's list
    (a class of the same module: GPT-2's double heads), each with the tasks it serves."""
    import transformers
    mappings = _mappings()
    out = []
    for family in families_:
        tasks: Dict[str, List[str]] = {family.model_class: []}
        for task, mapping in mappings:
            for name in _classes(mapping.get(family.model_type) or []):
                tasks.setdefault(name, []).append(task)
        for c in colossal:
            cls = getattr(transformers, c.name, None) if c.in_transformers else None
            base = getattr(transformers, tasks and next(iter(tasks)), None) if family.model_class != "-" else None
            if cls is not None and base is not None and cls.__module__ == base.__module__:
                tasks.setdefault(c.name, ["(ColossalAI's list)"])
        first, *others = tasks
        for name in [first] + sorted(others):
            out.append(Row(family, name, ", ".join(dict.fromkeys(tasks[name])) or "-"))
    return out
