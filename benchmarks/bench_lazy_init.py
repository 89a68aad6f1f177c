"""Lazy init: peak host memory of one rank of a 7B-class Llama (bf16) sharded tp=2 x pp=4, versus its shard.

8 gloo ranks (one process each) build the model on the meta device (no memory; after the warm-up build of a tiny
model, so that the modules a build imports are in the baseline) and shard it with the plugin's own
mesh, groups and Sharder. Only the two tp ranks of the measured stages materialize (`Sharder.materialize`, the
step `HybridParallelPlugin.configure` runs: allocate this rank's shard, HF `_init_weights` on it, broadcast
replicated tensors over tp); the others stay on meta, so the machine never holds more than those shards. Each
measured rank reports its peak RSS (VmHWM, and ru_maxrss) minus its RSS after imports and process-group setup,
against the bytes of its shard. Target: <= 1.3x.

    python benchmarks/bench_lazy_init.py [--stages 0 3] [--context] [--small]

`--context`: built as ColossalAI scripts build it, `with LazyInitContext(): AutoModelForCausalLM.from_config(config,
dtype=bf16)`, so that each rank's shard is eager init's (the default): the construction draws every tensor once on a
scratch tensor (to advance the RNG as eager init does), and materialization draws each tensor of the shard again,
whole, one at a time, keeping its slice (largest first). The peak counts both. Without it, the model is built
under `torch.device("meta")` and initialized per rank (what `LazyInitContext(per_rank_init=True)` does).
`--small`: the 7B's tensors but 4 layers, tp=2 x pp=2 (2 layers per stage instead of 8: the embedding and head
weigh more in a stage's shard), for a machine where every rank drawing a 7B model at construction takes too long.

`--pretrained`: lazy `from_pretrained` (ColossalAI's `with LazyInitContext(): AutoModelForCausalLM.from_pretrained`)
against the eager load, both boosted with tp=2 on 2 gloo ranks, on a ~670 MB fp32 Llama saved with save_pretrained.
Each mode runs in fresh processes; each rank reports its peak RSS during load + boost (VmHWM, reset with
/proc/self/clear_refs after process-group setup and a warm-up load + boost of a tiny model of the same class, so
that imports are not counted) minus its RSS then, against its shard's bytes. The lazy ranks read their shard from
the safetensors slices; the eager ones load the whole model, then shard it.

Not a test. Writes benchmarks/results/lazy_init[_context][_small].json (--pretrained: lazy_init_pretrained.json).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TP, PP = 2, 4
CONFIG = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
TINY = dict(CONFIG, vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=4)
SMALL, SMALL_PP = dict(CONFIG, num_hidden_layers=4), 2


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _build(config_kwargs: dict, context: bool):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from booster_plugin.compat import LazyInitContext

    config = LlamaConfig(**config_kwargs)
    if context:
        with LazyInitContext():
            return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16)  # free on meta


def _worker(rank: int, world: int, port: int, stages, config: dict, pp: int, context: bool, queue) -> None:
    import torch
    import torch.distributed as dist

    from booster_plugin import HybridParallelPlugin
    from shardformer.policies import get_autopolicy
    from shardformer.sharder import ShardConfig, Sharder

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        plugin = HybridParallelPlugin(tp_size=TP, pp_size=pp, num_microbatches=pp, precision="bf16")
        stage, tp_rank = plugin.stage, plugin.tp_rank
        measured = stage in stages
        _build(TINY, context)  # warm-up: the modules a build imports are in the baseline
        baseline_kb = _status_kb("VmRSS")
        baseline_maxrss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

        t0 = time.perf_counter()
        model = _build(config, context)
        t_build = time.perf_counter() - t0
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # what configure() does up to materialization, with the plugin's own groups
        shard_config = ShardConfig(tp=plugin.ctx.tp,
                                   pipeline_stage_manager=plugin.stage_manager,
                                   make_vocab_size_divisible_by=plugin.make_vocab_size_divisible_by)
        sharder = Sharder(model, get_autopolicy(model), shard_config)
        sharder.shard()
        t_shard = time.perf_counter() - t0
        dist.barrier()
        result = None
        if measured:  # both tp ranks of the stage (they broadcast replicated tensors to each other)
            t1 = time.perf_counter()
            shard_bytes = sharder.materialize(plugin.device)
            t_mat = time.perf_counter() - t1
            assert not any(p.is_meta for p in model.parameters())
            param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            peak_kb = _status_kb("VmHWM")
            maxrss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            result = {
                "rank": rank, "stage": stage, "tp_rank": tp_rank,
                "layers": sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if ".layers." in n}),
                "shard_bytes": shard_bytes, "shard_param_bytes": param_bytes, "full_model_bytes": full_bytes,
                "baseline_rss_bytes": baseline_kb * 1024,
                "peak_minus_baseline_bytes": (peak_kb - baseline_kb) * 1024,
                "ru_maxrss_minus_baseline_bytes": (maxrss_kb - baseline_maxrss_kb) * 1024,
                "ratio_vmhwm": (peak_kb - baseline_kb) * 1024 / shard_bytes,
                "ratio_ru_maxrss": (maxrss_kb - baseline_maxrss_kb) * 1024 / shard_bytes,
                "build_seconds": round(t_build, 2), "shard_seconds": round(t_shard, 2),
                "materialize_init_seconds": round(t_mat, 2),
            }
            queue.put(result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- --pretrained: lazy from_pretrained vs eager load at tp=2 ---------------------------------------------------------
PRETRAINED = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
        f.write("5")


def _load(path: str, mode: str):
    from transformers import AutoModelForCausalLM

    from booster_plugin.compat import LazyInitContext

    if mode == "eager":
        return AutoModelForCausalLM.from_pretrained(path)
    with LazyInitContext():
        return AutoModelForCausalLM.from_pretrained(path)


def _pretrained_worker(rank: int, world: int, port: int, path: str, tiny: str, mode: str, queue) -> None:
    import gc

    import torch
    import torch.distributed as dist

    from booster_plugin import Booster, HybridParallelPlugin

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # warm-up on a tiny model of the same class: the modules a load and a boost import are in the baseline
        Booster(plugin=HybridParallelPlugin(tp_size=world)).boost(_load(tiny, mode))
        booster = Booster(plugin=HybridParallelPlugin(tp_size=world))
        dist.barrier()
        gc.collect()
        baseline_kb = _status_kb("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        model = _load(path, mode)
        t_load = time.perf_counter() - t0
        model, *_ = booster.boost(model)
        t_total = time.perf_counter() - t0
        peak_kb = _status_kb("VmHWM")
        params = list(model.parameters())
        shard = sum(p.numel() * p.element_size() for p in params)
        queue.put({"rank": rank, "mode": mode, "shard_bytes": shard, "baseline_rss_bytes": baseline_kb * 1024,
                   "peak_minus_baseline_bytes": (peak_kb - baseline_kb) * 1024,
                   "ratio_to_shard": (peak_kb - baseline_kb) * 1024 / shard,
                   "checksum": float(sum(p.detach().double().sum() for p in params)),
                   "load_seconds": round(t_load, 2), "load_and_boost_seconds": round(t_total, 2)})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_pretrained() -> None:
    import tempfile

    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as root:
        path, tiny = os.path.join(root, "model"), os.path.join(root, "tiny")
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**{**PRETRAINED, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
                                        "num_hidden_layers": 1})).save_pretrained(tiny)
        model = LlamaForCausalLM(LlamaConfig(**PRETRAINED))
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(path)
        del model
        rows = {mode: _spawn(_pretrained_worker, 2, path, tiny, mode) for mode in ("eager", "lazy")}
    mib = 1024 ** 2
    print(f"Llama (hidden 1024, 8 layers, vocab 32000), fp32, {full_bytes / mib:.0f} MiB; boost tp=2 on 2 ranks")
    print(f"{'mode':>5} {'rank':>4} {'shard MiB':>9} {'peak-base MiB':>13} {'peak/shard':>10} {'load s':>6} "
          f"{'+boost s':>8}")
    for mode, mode_rows in rows.items():
        for r in mode_rows:
            print(f"{mode:>5} {r['rank']:>4} {r['shard_bytes'] / mib:>9.1f} "
                  f"{r['peak_minus_baseline_bytes'] / mib:>13.1f} {r['ratio_to_shard']:>10.3f} "
                  f"{r['load_seconds']:>6.2f} {r['load_and_boost_seconds']:>8.2f}")
    same = all(a["checksum"] == b["checksum"] for a, b in zip(rows["eager"], rows["lazy"]))
    ratio = max(r["peak_minus_baseline_bytes"] for r in rows["lazy"]) / \
        max(r["peak_minus_baseline_bytes"] for r in rows["eager"])
    print(f"worst rank's peak, lazy / eager: {ratio:.3f}; shards equal (checksum): {same}")
    out = {"benchmark": "lazy_init_pretrained", "model": PRETRAINED, "dtype": "float32", "tp_size": 2,
           "full_model_bytes": full_bytes, "peak_ratio_lazy_to_eager": ratio, "shards_equal": same, "ranks": rows,
           "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "cpu_count": os.cpu_count(), "when": time.strftime("%Y-%m-%dT%H:%M:%S")}}
    path = os.path.join(ROOT, "benchmarks", "results", "lazy_init_pretrained.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {path}")


def _spawn(target, world: int, *args) -> list:
    """Run `target(rank, world, port, *args, queue)` on `world` fresh processes; the rows they put, by rank."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    rows = []
    while not queue.empty():
        rows.append(queue.get())
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=None,
                        help="pipeline stages whose ranks materialize and are measured (default: first and last)")
    parser.add_argument("--context", action="store_true", help="build under LazyInitContext: eager init's weights")
    parser.add_argument("--small", action="store_true", help="a smaller shape (see the module docstring)")
    parser.add_argument("--pretrained", action="store_true",
                        help="lazy from_pretrained vs eager load, tp=2 on 2 ranks (see the module docstring)")
    args = parser.parse_args()
    if args.pretrained:
        _run_pretrained()
        return
    config, pp = (SMALL, SMALL_PP) if args.small else (CONFIG, PP)
    stages = args.stages if args.stages is not None else [0, pp - 1]
    rows = _spawn(_worker, TP * pp, tuple(stages), config, pp, args.context)

    gib = 1024 ** 3
    init = "LazyInitContext: eager init" if args.context else "meta: per-rank init"
    print(f"Llama (hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
          f"vocab {config['vocab_size']}), bf16, tp={TP} x pp={pp}, {init}; "
          f"full model {rows[0]['full_model_bytes'] / gib:.2f} GiB")
    header = (f"{'rank':>4} {'stage':>5} {'tp':>2} {'layers':>8} {'shard GiB':>9} {'peak-base GiB':>13} "
              f"{'ratio':>6} {'ru_maxrss ratio':>15} {'build s':>7} {'init s':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        layers = f"{r['layers'][0]}-{r['layers'][-1]}"
        print(f"{r['rank']:>4} {r['stage']:>5} {r['tp_rank']:>2} {layers:>8} {r['shard_bytes'] / gib:>9.3f} "
              f"{r['peak_minus_baseline_bytes'] / gib:>13.3f} {r['ratio_vmhwm']:>6.3f} {r['ratio_ru_maxrss']:>15.3f} "
              f"{r['build_seconds']:>7.1f} {r['materialize_init_seconds']:>6.1f}")
    worst = max(r["ratio_vmhwm"] for r in rows)
    print(f"worst peak / shard: {worst:.3f}x (target <= 1.3x): {'OK' if worst <= 1.3 else 'MISSED'}")
    import torch
    import transformers
    name = "lazy_init" + ("_context" if args.context else "") + ("_small" if args.small else "")
    out = {"benchmark": name, "model": config, "dtype": "bfloat16", "tp_size": TP, "pp_size": pp,
           "init": "eager (LazyInitContext)" if args.context else "per rank (meta device)",
           "measured_stages": stages, "target_ratio": 1.3, "worst_ratio": worst, "ranks": rows,
           "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "cpu_count": os.cpu_count(), "when": time.strftime("%Y-%m-%dT%H:%M:%S")}}
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    path = os.path.join(ROOT, "benchmarks", "results", f"{name}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
