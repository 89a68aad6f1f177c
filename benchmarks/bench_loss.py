"""Head + loss of a causal LM with a large vocabulary, side by side in one run: transformers' own path (the LM head's
full logits, then `ForCausalLMLoss`, as one process and our plugin with chunked_loss=False compute it) against the
chunked linear cross-entropy our plugin runs by default (shardformer/layer/linear_cross_entropy.py, as
shardformer/chunked_loss.py calls it: labels shifted, the sum over chunks divided by the number of targets).

Per variant, forward + backward of the loss with respect to the hidden states and the head's weight:
- peak memory allocated during the step, above what existed before it (the weight, the hidden states, the labels):
  on CUDA torch.cuda.max_memory_allocated, on CPU the allocator's running total as torch's profiler reports it
  (`[memory]` events, from the total before the step's first allocation); also the peak less the weight's gradient, which both variants end with (the part the loss's
  activations and temporaries take);
- time: the median of `--repeats` steps (after one untimed step), without the profiler;
- agreement: loss and gradients of the two variants (max abs difference).
The full variant keeps its logits alive through the backward, as a model's output holding them does.

Run:  python benchmarks/bench_loss.py [--vocab 128256 --hidden 2048 --seq 2048 --rows 1 --dtype fp32 --repeats 3]
                                      [--compiled: also the chunked loss compiled, as under compile_layers=True]
Writes benchmarks/results/loss.json (loss_rows{N}.json with --rows N > 1).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, Tuple

import _common as C  # sets OMP_NUM_THREADS before torch loads
import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from shardformer.layer.linear_cross_entropy import VocabShard, chunk_tokens, linear_cross_entropy_sum

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Tuple[torch.Tensor, Any]]


def full_step(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, Any]:
    logits = F.linear(hidden, weight)  # what the model's forward returns as `logits`
    return ForCausalLMLoss(logits, labels, vocab_size=weight.size(0)), logits


def chunked_step(chunk, compiled: bool = False):
    def step(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
        total = linear_cross_entropy_sum(hidden.reshape(-1, hidden.size(-1)), weight, None, targets.reshape(-1),
                                         VocabShard(0, weight.size(0)), chunk=chunk, compiled=compiled)
        return total / (targets != -100).sum(), None
    return step


def _run(step: Step, hidden, weight, labels) -> torch.Tensor:
    hidden.grad = weight.grad = None
    loss, kept = step(hidden, weight, labels)
    loss.backward()
    del kept
    return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_bytes(step: Step, hidden, weight, labels) -> int:
    """Peak bytes allocated during one step, above those allocated before it."""
    hidden.grad = weight.grad = None
    if hidden.device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _run(step, hidden, weight, labels)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _run(step, hidden, weight, labels)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    memory = [e["args"] for e in events if e.get("name") == "[memory]"]
    if not memory:
        return 0
    # the profiler's running total goes on from an earlier session (what that one left allocated): start from it
    start = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return max(m["Total Allocated"] for m in memory) - start


def seconds(step: Step, hidden, weight, labels, repeats: int) -> float:
    times = []  # (the caller's first step warmed up)
    for _ in range(repeats):
        _sync(hidden.device)
        start = time.perf_counter()
        _run(step, hidden, weight, labels)
        _sync(hidden.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: chosen from the shapes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compiled", action="store_true",
                        help="also the chunked loss with its per-chunk arithmetic compiled (compile_layers=True)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(device, dtype).requires_grad_()
    hidden = torch.randn(args.rows, args.seq, args.hidden, generator=g).to(device, dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows, args.seq), generator=g).to(device)
    labels[:, : args.seq // 16] = -100  # a prompt without loss
    variants: Dict[str, Step] = {"full": full_step, "chunked": chunked_step(args.chunk)}
    if args.compiled:
        variants["chunked compiled"] = chunked_step(args.chunk, compiled=True)
    results: Dict[str, Any] = {"config": vars(args), "device": str(device), "tokens": args.rows * args.seq,
                               "chunk_tokens": chunk_tokens(args.rows * args.seq, args.hidden, args.vocab, args.chunk),
                               "env": _environment(device), "variants": {}}
    grads = {}
    weight_grad_bytes = weight.numel() * weight.element_size()
    for name, step in variants.items():
        loss = _run(step, hidden, weight, labels)
        grads[name] = (loss, hidden.grad.clone(), weight.grad.clone())
        peak = peak_bytes(step, hidden, weight, labels)
        results["variants"][name] = {"loss": float(loss), "peak_gib": peak / 2**30,
                                     "peak_less_weight_grad_gib": (peak - weight_grad_bytes) / 2**30,
                                     "step_s": seconds(step, hidden, weight, labels, args.repeats)}
        print(name, json.dumps(results["variants"][name]), flush=True)
    full, chunked = results["variants"]["full"], results["variants"]["chunked"]
    results["ratio_peak"] = chunked["peak_gib"] / full["peak_gib"]
    results["ratio_peak_less_weight_grad"] = chunked["peak_less_weight_grad_gib"] / full["peak_less_weight_grad_gib"]
    results["ratio_time"] = chunked["step_s"] / full["step_s"]
    if "chunked compiled" in results["variants"]:
        results["ratio_time_compiled"] = results["variants"]["chunked compiled"]["step_s"] / full["step_s"]
    results["max_abs_diff"] = {what: float((a.float() - b.float()).abs().max())
                               for what, a, b in zip(("loss", "hidden_grad", "weight_grad"), grads["full"],
                                                     grads["chunked"])}
    print(C.table(["variant", "peak GiB", "peak less weight grad GiB", "step s"],
                  [[n, f"{v['peak_gib']:.3f}", f"{v['peak_less_weight_grad_gib']:.3f}", f"{v['step_s']:.2f}"]
                   for n, v in results["variants"].items()]))
    print(f"chunked / full: peak {results['ratio_peak']:.3f}, peak less weight grad "
          f"{results['ratio_peak_less_weight_grad']:.3f}, time {results['ratio_time']:.2f}; "
          f"max abs diff {results['max_abs_diff']}")
    results["loadavg_at_end"] = C.loadavg()
    print("wrote " + C.write_results("loss" if args.rows == 1 else f"loss_rows{args.rows}", results))


def _environment(device: torch.device) -> Dict[str, Any]:
    import platform

    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
           "cpu_count": os.cpu_count(), "machine": platform.machine(), "loadavg_at_start": C.loadavg()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


if __name__ == "__main__":
    main()
