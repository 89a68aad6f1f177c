"""One GPU, bf16: our HybridParallelPlugin (tp=1, pp=1) against the plain torch loops it should cost nothing over.

Every row trains a fresh copy of the same model (same seed, so the same initial weights: checked by a fingerprint)
on the same batches, for `--warmup` untimed and `--steps` timed steps:

  ours bf16            HybridParallelPlugin(tp_size=1, pp_size=1, precision="bf16"): the model in bf16, fp32 master
                       weights in the optimizer; a step = forward with labels, booster.backward(loss, optimizer),
                       optimizer.step(), optimizer.zero_grad().
  ours bf16 mb=2       the same plugin with num_microbatches=2: booster.execute_pipeline(iter([batch]), model,
                       lambda out, b: out.loss, optimizer) (gradient accumulation over 2 microbatches), step, zero_grad.
  plain autocast       an fp32 model, forward under torch.autocast(device, torch.bfloat16), loss.backward(), fp32
                       AdamW, zero_grad.
  plain autocast ga=2  the same over 2 microbatches of half the rows, each loss / 2 (gradient accumulation).
  pure bf16            model.to(torch.bfloat16), AdamW over the bf16 parameters (no master weights).
  plain compiled       plain autocast with each decoder layer `.compile()`d (regional compilation by hand: the bar
                       the issue set, 48.4% MFU on an H200).
  ours compiled        ours bf16 with compile_layers=True (regional compilation: each decoder layer compiled).
  ours liger           ours bf16 with fused_kernels="liger" (Liger-Kernel's RMSNorm/LayerNorm); skipped, saying
                       why, where Liger cannot run (no CUDA, liger_kernel not installed).
  ours all_opt         ours bf16 with ColossalAI's enable_all_optimization=True (compiled layers, Liger's norms
                       where it runs, sdpa / flash_attention_2, chunked loss).

Every side: AdamW(lr=1e-4) with fused=True where torch has it for the device (ours: the fused flag lives in the inner
optimizer's param groups, which step the fp32 masters; checked per row), model.train(), use_cache=False, sdpa
attention, the model's own causal-LM loss (plus the router's auxiliary loss for the MoE model).

Models (random init, no hub): a Llama-3.2-1B shape (hidden 2048, 16 layers, 32 heads / 8 kv heads, intermediate 8192,
vocab 128256, tied embeddings, rope_theta 500000) and a Qwen3-MoE shape (hidden 2048, 8 layers, 32 / 4 heads,
head_dim 128, 64 experts top-8, moe_intermediate_size 768, vocab 151936, output_router_logits=True,
router_aux_loss_coef 0.001; 4 layers on a GPU with less than 100 GiB), both at 4 rows x 2048 tokens per step.

Per row: median step ms (torch.cuda.synchronize around each timed step), tokens/s, MFU =
(6 * N_active + 12 * L * h_attn * S) * tokens / (step time * peak), peak memory (max_memory_allocated, reset per row),
the first 3 losses. N_active: the parameters a token's matmuls use (the input embedding counts only where it is tied
to the LM head; routed experts count top_k / num_experts of theirs); h_attn = heads * head_dim. Peak: 989.4 TFLOP/s
dense bf16 on H100 / H200 (by device name), else --peak-tflops (no MFU without one).

Under autocast, transformers' default MoE kernel (grouped_mm; torch's grouped_mm is not on autocast's list) runs the
experts in the weights' dtype, fp32: the MoE rows of the plain autocast loop are slower by that (noted in the table),
and the pure-bf16 row is the like-for-like reference there.

Run:  python benchmarks/bench_gpu.py [--steps N] [--warmup N] [--models llama,qwen_moe] [--sides ours,plain,...]
                                    [--tiny] [--peak-tflops T] [--out PATH]
      (a world of one process: initializes torch.distributed itself, no torchrun needed)
      --tiny: tiny configs at seq 64 that run on a CPU in seconds (a smoke test of the script, not a benchmark).
Writes benchmarks/results/gpu.json (--tiny: gpu_tiny.json; or --out).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import _common as C  # sets OMP_NUM_THREADS before torch loads; puts the repo root on sys.path
import torch
import torch.distributed as dist

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.core.fused_kernels import liger_unusable

NAME = "gpu"
LR = 1e-4
SEED = 0
DATA_SEED = 1234
N_BATCHES = 4  # distinct batches, cycled; every side sees the same sequence
H100_H200_PEAK_TFLOPS = 989.4  # dense bf16, SXM

OURS, OURS_MB2, PLAIN, PLAIN_GA2, PURE_BF16 = "ours bf16", "ours bf16 mb=2", "plain autocast", \
    "plain autocast ga=2", "pure bf16"
OURS_COMPILED, OURS_LIGER, OURS_ALL = "ours compiled", "ours liger", "ours all_opt"
PLAIN_COMPILED = "plain compiled"
SIDES = (OURS, OURS_MB2, PLAIN, PLAIN_GA2, PURE_BF16, PLAIN_COMPILED, OURS_COMPILED, OURS_LIGER, OURS_ALL)
SIDE_KEYS = {"ours": OURS, "ours_mb2": OURS_MB2, "plain": PLAIN, "plain_ga2": PLAIN_GA2, "bf16": PURE_BF16,
             "plain_compiled": PLAIN_COMPILED, "ours_compiled": OURS_COMPILED, "ours_liger": OURS_LIGER, "ours_all": OURS_ALL}
# the ratios reported: (numerator row, denominator row)
RATIOS = ((OURS, PLAIN), (OURS_MB2, PLAIN_GA2), (PLAIN_COMPILED, PLAIN), (OURS_COMPILED, OURS), (OURS_LIGER, OURS),
          (OURS_ALL, OURS), (OURS_ALL, PLAIN_COMPILED))
# the speed switches' rows: ours bf16 plus these plugin arguments
SWITCHES = {OURS_COMPILED: dict(compile_layers=True), OURS_LIGER: dict(fused_kernels="liger"),
            OURS_ALL: dict(enable_all_optimization=True)}


# -- setup ----------------------------------------------------------------------------------------------------------
def init_world(device: torch.device) -> None:
    """A world of one process: torchrun's environment if present, else defaults (so plain `python` works)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(C._free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if os.environ["WORLD_SIZE"] != "1":
        raise SystemExit("bench_gpu.py runs as one process: `python benchmarks/bench_gpu.py` (not torchrun -n > 1).")
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)


def peak_flops(device: torch.device, given_tflops: Optional[float]) -> Tuple[Optional[float], str]:
    """(peak FLOP/s, where it came from): --peak-tflops, else H100/H200 by device name, else unknown."""
    if given_tflops is not None:
        return given_tflops * 1e12, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if "H100" in name or "H200" in name:
            return H100_H200_PEAK_TFLOPS * 1e12, f"{name}: dense bf16"
        return None, f"{name}: unknown, pass --peak-tflops"
    return None, "CPU: no MFU (pass --peak-tflops to get one)"


def environment(device: torch.device) -> Dict[str, Any]:
    import platform

    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": str(device), "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "loadavg_at_start": C.loadavg()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                   sm_count=props.multi_processor_count, cuda=torch.version.cuda,
                   allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    else:
        env.update(cpu_count=os.cpu_count(), threads=torch.get_num_threads())
    return env


# -- models ---------------------------------------------------------------------------------------------------------
def model_specs(tiny: bool, gpu_gib: Optional[float], moe_layers: Optional[int]) -> Dict[str, Dict[str, Any]]:
    """name -> {cls, config kwargs, batch rows, seq}. Shapes as in the module docstring."""
    common = dict(use_cache=False, attn_implementation="sdpa", attention_dropout=0.0)
    if tiny:
        llama = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=512, tie_word_embeddings=True, rope_theta=500000.0,
                     max_position_embeddings=64)
        moe = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=512,
                   max_position_embeddings=64)
        rows, seq = 4, 64
    else:
        llama = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                     max_position_embeddings=131072, rms_norm_eps=1e-5)
        if moe_layers is None:  # ours holds ~20 B/param (bf16 weights + grads, fp32 masters + grads + Adam)
            moe_layers = 8 if gpu_gib is None or gpu_gib >= 100 else 4
        moe = dict(hidden_size=2048, num_hidden_layers=moe_layers, num_attention_heads=32, num_key_value_heads=4,
                   head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768,
                   vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)
        rows, seq = 4, 2048
    moe.update(norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.001, tie_word_embeddings=False,
               decoder_sparse_step=1, mlp_only_layers=[])
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    return {"llama": {"cls": LlamaForCausalLM, "config": LlamaConfig(**llama, **common), "rows": rows, "seq": seq},
            "qwen_moe": {"cls": Qwen3MoeForCausalLM, "config": Qwen3MoeConfig(**moe, **common), "rows": rows,
                         "seq": seq}}


def build(spec: Dict[str, Any], device: torch.device) -> torch.nn.Module:
    """A fresh fp32 model, initialized on `device` from SEED (the same weights for every side)."""
    torch.manual_seed(SEED)
    with torch.device(device):
        model = spec["cls"](spec["config"])
    model.train()
    return model


@torch.no_grad()
def fingerprint(model: torch.nn.Module) -> float:
    """A float64 sum of every parameter: equal across rows iff (almost surely) the initial weights are."""
    return float(sum(torch.sum(p, dtype=torch.float64) for p in model.parameters()).item())


def count_params(model: torch.nn.Module) -> Tuple[int, float]:
    """(all parameters, those a token's matmuls use: N_active, see the module docstring)."""
    cfg = model.config
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    experts = getattr(cfg, "num_experts", None)
    total, active = 0, 0.0
    for name, p in model.named_parameters():  # (a tied weight once)
        n = p.numel()
        total += n
        if name.endswith("embed_tokens.weight") and not tied:
            continue  # a lookup, not a matmul
        if ".experts." in name and experts:
            n = n * cfg.num_experts_per_tok / experts
        active += n
    return total, active


def flops_per_token(model: torch.nn.Module, seq: int) -> float:
    cfg = model.config
    _, active = count_params(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 6 * active + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * seq


def make_batches(spec: Dict[str, Any], device: torch.device) -> List[Dict[str, torch.Tensor]]:
    """N_BATCHES batches of random ids (labels = ids; the model shifts them), built on the CPU from DATA_SEED."""
    g = torch.Generator().manual_seed(DATA_SEED)
    out = []
    for _ in range(N_BATCHES):
        ids = torch.randint(0, spec["config"].vocab_size, (spec["rows"], spec["seq"]), generator=g)
        out.append({"input_ids": ids.to(device), "labels": ids.to(device)})
    return out


def halves(batch: Dict[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
    """Two microbatches of half the rows (as our plugin splits along dim 0)."""
    return [{k: v.chunk(2)[i] for k, v in batch.items()} for i in range(2)]


def fused_supported(device: torch.device) -> bool:
    """Whether torch's AdamW takes fused=True on `device` (CUDA; the CPU in recent torch)."""
    try:
        p = torch.nn.Parameter(torch.zeros(2, device=device))
        p.grad = torch.zeros_like(p)
        torch.optim.AdamW([p], lr=LR, fused=True).step()
        return True
    except (RuntimeError, ValueError):
        return False


def adamw(params, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, fused=True) if fused else torch.optim.AdamW(params, lr=LR)


# -- the sides: each returns (step(batch) -> loss tensor, what to report about it, cleanup objects) -----------------
def side_ours(model, device, fused: bool, microbatches: int, switches: Optional[Dict[str, Any]] = None):
    kwargs = {"num_microbatches": microbatches} if microbatches > 1 else {}
    plugin = HybridParallelPlugin(tp_size=1, pp_size=1, precision="bf16", **kwargs, **(switches or {}))
    booster = Booster(plugin=plugin)
    optimizer = adamw(model.parameters(), fused)
    model, optimizer, *_ = booster.boost(model, optimizer)
    criterion = lambda out, b: out.loss  # noqa: E731

    if microbatches > 1:
        def step(batch):
            loss = booster.execute_pipeline(iter([batch]), model, criterion, optimizer)["loss"]
            optimizer.step()
            optimizer.zero_grad()
            return loss
    else:
        def step(batch):
            loss = model(**batch).loss
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            return loss
    inner = optimizer.unwrap()
    stepped = inner.param_groups[0]["params"][0]
    info = {"fused": bool(inner.param_groups[0].get("fused")), "model_dtype": str(next(model.parameters()).dtype),
            "stepped_dtype": str(stepped.dtype), "training": model.unwrap().training,
            "switches": {k: str(v) for k, v in vars(plugin.config.sharding.speed).items()}}
    return step, info, [model, optimizer, booster, plugin]


def side_plain(model, device, fused: bool, microbatches: int):
    optimizer = adamw(model.parameters(), fused)
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731

    if microbatches > 1:
        def step(batch):
            total = 0.0
            for mb in halves(batch):
                with autocast():
                    loss = model(**mb).loss / 2
                loss.backward()
                total = total + loss.detach()
            optimizer.step()
            optimizer.zero_grad()
            return total
    else:
        def step(batch):
            with autocast():
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss
    info = {"fused": bool(optimizer.param_groups[0].get("fused")), "model_dtype": "float32 (autocast bf16)",
            "stepped_dtype": "torch.float32", "training": model.training}
    return step, info, [model, optimizer]


def side_plain_compiled(model, device, fused: bool, microbatches: int):
    """The plain autocast loop with every decoder layer compiled in place (`nn.Module.compile`)."""
    for layer in model.model.layers:
        layer.compile()
    step, info, keep = side_plain(model, device, fused, microbatches)
    return step, dict(info, compiled="each decoder layer"), keep


def side_pure_bf16(model, device, fused: bool, microbatches: int):
    model.to(torch.bfloat16)
    optimizer = adamw(model.parameters(), fused)

    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss
    info = {"fused": bool(optimizer.param_groups[0].get("fused")), "model_dtype": "torch.bfloat16",
            "stepped_dtype": "torch.bfloat16", "training": model.training}
    return step, info, [model, optimizer]


SIDE_BUILDERS: Dict[str, Tuple[Callable, int]] = {
    OURS: (side_ours, 1), OURS_MB2: (side_ours, 2), PLAIN: (side_plain, 1), PLAIN_GA2: (side_plain, 2),
    PURE_BF16: (side_pure_bf16, 1), PLAIN_COMPILED: (side_plain_compiled, 1),
    **{side: (functools.partial(side_ours, switches=switches), 1) for side, switches in SWITCHES.items()}}


# -- one row --------------------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_row(side: str, spec: Dict[str, Any], batches, device, args, fused: bool) -> Dict[str, Any]:
    """Build a fresh model, boost or wrap it for `side`, run warm-up and timed steps; the row's numbers."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model = build(spec, device)
    row: Dict[str, Any] = {"init_fingerprint": fingerprint(model),
                           "experts_implementation": getattr(model.config, "_experts_implementation", None),
                           "attn_implementation": model.config._attn_implementation}
    if side in (PLAIN, PLAIN_GA2) and row["experts_implementation"] == "grouped_mm":
        # torch's grouped_mm is not on autocast's list: transformers runs it in the weights' dtype, fp32 here
        row["note"] = "experts fp32 (grouped_mm not autocast)"
    if side == OURS_LIGER and liger_unusable(device) is not None:  # said, not faked: no row without Liger
        return {"skipped": liger_unusable(device)}
    builder, microbatches = SIDE_BUILDERS[side]
    step, info, keep = builder(model, device, fused, microbatches)
    del model
    row.update(info, microbatches=microbatches)
    sync(device)
    row["build_s"] = time.perf_counter() - t0
    losses, times = [], []
    try:
        for i in range(args.warmup + args.steps):
            batch = batches[i % len(batches)]
            sync(device)
            t = time.perf_counter()
            loss = step(batch)
            sync(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
            losses.append(loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss)))
            if i == 0:
                row["first_step_s"] = time.perf_counter() - t  # (compilation happens here)
        row["losses"] = [float(x) for x in losses]
        row["step_ms"] = [t * 1e3 for t in times]
        row["median_step_ms"] = C.median(row["step_ms"])
        if device.type == "cuda":
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
            row["mem_after_step_gib"] = torch.cuda.memory_allocated(device) / 2 ** 30  # weights + optimizer state
    finally:
        del step, keep, losses
        free(device)
    return row


def fmt_losses(losses: List[float]) -> str:
    return ", ".join(f"{x:.4f}" for x in losses[:3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 8; --tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; --tiny 1)")
    parser.add_argument("--models", default="llama,qwen_moe", help="comma-separated: llama, qwen_moe")
    parser.add_argument("--sides", default=",".join(SIDE_KEYS),
                        help="comma-separated rows to run: " + ", ".join(f"{k} ({v})" for k, v in SIDE_KEYS.items()))
    parser.add_argument("--tiny", action="store_true", help="tiny configs at seq 64 (CPU smoke test, seconds)")
    parser.add_argument("--moe-layers", type=int, default=None,
                        help="Qwen3-MoE layers (default 8; 4 on a GPU with less than 100 GiB)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak dense bf16 TFLOP/s for MFU (default: 989.4 on H100/H200, else no MFU)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--out", default=None, help=f"results JSON (default benchmarks/results/{NAME}.json; --tiny: "
                        f"{NAME}_tiny.json, git-ignored, so a smoke run leaves the GPU results alone)")
    args = parser.parse_args()
    args.steps = args.steps if args.steps is not None else (2 if args.tiny else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.out = args.out or os.path.join(C.RESULTS_DIR, f"{NAME}_tiny.json" if args.tiny else f"{NAME}.json")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    keys = [s.strip() for s in args.sides.split(",") if s.strip()]
    for k in keys:
        if k not in SIDE_KEYS:
            parser.error(f"unknown side {k!r}; choose from: {', '.join(SIDE_KEYS)}")
    sides = [SIDE_KEYS[k] for k in keys]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    t_start = time.perf_counter()
    init_world(device)
    gpu_gib = torch.cuda.get_device_properties(device).total_memory / 2 ** 30 if device.type == "cuda" else None
    specs = model_specs(args.tiny, gpu_gib, args.moe_layers)
    for m in models:
        if m not in specs:
            parser.error(f"unknown model {m!r}; choose from: {', '.join(specs)}")
    peak, peak_source = peak_flops(device, args.peak_tflops)
    fused = fused_supported(device)
    results: Dict[str, Any] = {"env": environment(device), "args": vars(args), "peak_flops": peak,
                               "peak_source": peak_source, "fused_adamw": fused, "lr": LR, "models": {}}
    print(f"bench_gpu: {results['env'].get('gpu', 'CPU')} ({device}), torch {torch.__version__}, peak "
          f"{peak / 1e12 if peak else 'n/a'} TFLOP/s ({peak_source}), fused AdamW {fused}, "
          f"{args.warmup} warm-up + {args.steps} timed steps per row", flush=True)
    failed = []
    for name in models:
        spec = specs[name]
        tokens = spec["rows"] * spec["seq"]
        with torch.device("meta"):  # the counts, without allocating
            shape_model = spec["cls"](spec["config"])
        n_total, n_active = count_params(shape_model)
        fpt = flops_per_token(shape_model, spec["seq"])
        del shape_model
        entry: Dict[str, Any] = {"config": spec["config"].to_diff_dict(), "rows": spec["rows"], "seq": spec["seq"],
                                 "tokens_per_step": tokens, "params": n_total, "params_active": n_active,
                                 "flops_per_token": fpt, "sides": {}}
        results["models"][name] = entry
        print(f"\n{name}: {n_total / 1e6:.1f} M params ({n_active / 1e6:.1f} M active), {spec['rows']} x "
              f"{spec['seq']} tokens per step, {fpt / 1e9:.3f} GFLOP per token", flush=True)
        batches = make_batches(spec, device)
        for side in sides:
            try:
                row = run_row(side, spec, batches, device, args, fused)
            except Exception as error:  # one row failing (e.g. out of memory) still reports the others
                traceback.print_exc()
                row = {"error": f"{type(error).__name__}: {error}"[:2000]}
                failed.append(f"{name}/{side}")
            free(device)  # (after the except block: its traceback no longer holds the row's tensors)
            if "median_step_ms" in row:
                s = row["median_step_ms"] / 1e3
                row["tokens_per_s"] = tokens / s
                row["mfu"] = fpt * tokens / s / peak if peak else None
            entry["sides"][side] = row
            write(results, args.out)  # after every row: a run cut off by a time limit keeps what it measured
            if "error" in row:
                print(f"  {side}: FAILED {row['error'][:300]}", flush=True)
            elif "skipped" in row:
                print(f"  {side}: skipped: {row['skipped']}", flush=True)
            else:
                mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "n/a"
                print(f"  {side}: {row['median_step_ms']:.1f} ms/step, MFU {mfu}, peak "
                      f"{row.get('peak_mem_gib', float('nan')):.1f} GiB, first losses {fmt_losses(row['losses'])} "
                      f"(built in {row['build_s']:.1f} s, first step {row['first_step_s']:.1f} s)", flush=True)
        del batches
        free(device)
        prints = {s: r["init_fingerprint"] for s, r in entry["sides"].items() if "init_fingerprint" in r}
        entry["same_init"] = len(set(prints.values())) <= 1
        for num, den in RATIOS:
            a, b = entry["sides"].get(num, {}), entry["sides"].get(den, {})
            if "tokens_per_s" in a and "tokens_per_s" in b:
                entry.setdefault("ratio_ours_over_plain", {})[f"{num} / {den}"] = a["tokens_per_s"] / b["tokens_per_s"]
    results["failed"] = failed
    results["total_s"] = time.perf_counter() - t_start
    results["loadavg_at_end"] = C.loadavg()
    results["table"] = report(results)
    print("\n" + results["table"], flush=True)
    write(results, args.out)
    print(f"total {results['total_s']:.0f} s; wrote {args.out}", flush=True)
    dist.destroy_process_group()
    return 1 if failed else 0


def write(results: Dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=2, default=str)
    os.replace(path + ".tmp", path)


def report(results: Dict[str, Any]) -> str:
    """The table (and ratios) from a results dict; also used by `make gpu-check`'s summary."""
    headers = ["model", "side", "step ms", "tokens/s", "MFU %", "peak GiB", "first 3 losses", "fused", "note"]
    rows, lines = [], []
    for name, entry in results["models"].items():
        for side, r in entry["sides"].items():
            if "error" in r:
                rows.append([name, side, "-", "-", "-", "-", "-", "-", "FAILED: " + r["error"][:60]])
                continue
            if "skipped" in r:
                rows.append([name, side, "-", "-", "-", "-", "-", "-", "skipped: " + r["skipped"][:60]])
                continue
            mfu = f"{100 * r['mfu']:.1f}" if r.get("mfu") is not None else "n/a"
            mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "n/a"
            note = r.get("note") or (f"experts {r['experts_implementation']}" if "moe" in name else "")
            rows.append([name, side, f"{r['median_step_ms']:.1f}", f"{r['tokens_per_s']:.0f}", mfu, mem,
                         fmt_losses(r["losses"]), "yes" if r.get("fused") else "no", note])
        for label, ratio in entry.get("ratio_ours_over_plain", {}).items():
            lines.append(f"{name}: tokens/s {label} = {ratio:.3f}")
        if not entry.get("same_init", True):
            lines.append(f"{name}: WARNING: the rows started from different weights (init fingerprints differ)")
    return C.table(headers, rows) + ("\n" + "\n".join(lines) if lines else "")


if __name__ == "__main__":
    sys.exit(main())
