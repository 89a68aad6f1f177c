"""python -m hp_check MODEL_CLASS_OR_CONFIG_DIR --tp 2 --pp 2 [--policy module:Class]

Builds the model (a tiny config of the class with random weights, or the config in a directory) on tp * pp CPU
processes, trains one step sharded and unsharded, and reports whether loss, gradients and parameters after AdamW
match; on a mismatch it names the first parameter (Hugging Face name) that differs. Exit status: 0 pass, 1 fail,
2 refused (the reason is printed), 3 the unsharded model itself fails, 4 the check could not run (a rank crashed,
hung or could not start, e.g. a port taken: nothing was compared; run it again)."""
from __future__ import annotations

import argparse
import os
from typing import Optional

from .launch import LaunchFailed, run_standalone
from .tiny import model_class, tiny_config


def build_model(target: str):
    """A model from a class name / module:Class (tiny config) or a directory holding a config.json: the class its
    `architectures` names (a classifier, a VLM, ...), else a causal LM, else the base model."""
    if os.path.isdir(target):
        import transformers
        config = transformers.AutoConfig.from_pretrained(target)
        for name in getattr(config, "architectures", None) or []:
            cls = getattr(transformers, name, None)
            if cls is not None:
                return cls._from_config(config)
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
            try:
                return auto.from_config(config)
            except ValueError:
                continue
        raise ValueError(f"No transformers model class for the config in {target}.")
    cls = model_class(target)
    return cls(tiny_config(cls.config_class))


def _run(target: str, tp: int, pp: int, policy_path: Optional[str]):
    from .compare import compare
    policy = model_class(policy_path)() if policy_path else None
    return tuple(compare(lambda: build_model(target), tp, pp, policy, progress=_progress))


def _progress(what: str) -> None:
    import torch.distributed as dist
    if dist.get_rank() == 0:
        print(f"[hp_check] {what}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hp_check", description=__doc__.split("\n\n")[1])
    parser.add_argument("model", help="model class name (e.g. Qwen3ForCausalLM), module:Class, or a config directory")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--policy", help="module:Class of a shardformer.Policy to check instead of the built-in one")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck run is ended")
    args = parser.parse_args(argv)
    print(f"[hp_check] {args.model}: launching {args.tp * args.pp} ranks (tp={args.tp}, pp={args.pp})", flush=True)
    try:
        reports = run_standalone(args.tp * args.pp, _run, args.model, args.tp, args.pp, args.policy, timeout_s=args.timeout)
    except LaunchFailed as failed:  # not a mismatch: nothing was compared
        print(f"ERROR {args.model} tp={args.tp} pp={args.pp}: the check could not run ({failed}); nothing was "
              f"compared (exit status 4)")
        return 4
    errors = [r for r in reports if r[1] == "error"]
    if errors:
        print(f"ERROR {args.model} tp={args.tp} pp={args.pp}: the check could not run (rank {errors[0][0]}: "
              f"{errors[0][2]}); nothing was compared (exit status 4)")
        return 4
    result, detail, _ = reports[0][2]
    print(f"{result.upper()} {args.model} tp={args.tp} pp={args.pp}" + (f": {detail}" if detail else ""))
    return {"pass": 0, "fail": 1, "refused": 2, "untested": 3}[result]

