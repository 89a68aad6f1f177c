"""Communication per training step, per rank: number of collectives / P2P messages and their payload bytes, measured
by wrapping torch.distributed's functions, against the analytic minimum of each layout.

Layouts (HybridParallelPlugin uses the whole world, so one torchrun per world size):
  tp=2 | pp=2, m=4 | dp=2          on 2 ranks
  tp=2 x pp=2, m=4                 on 4 ranks
Model: the benchmark Llama of _common.py (hidden 256, 8 layers, 4 heads, ffn 1024, vocab 1024, untied), seq 128,
batch 8 per rank, fp32, AdamW. One warm-up step, then one counted step (forward, backward, optimizer.step,
zero_grad). Counted: all_reduce, all_gather(_into_tensor), reduce_scatter(_tensor), broadcast, reduce, all_to_all,
gather, scatter, barrier, send/recv, isend/irecv, batch_isend_irecv (each op inside it is a message), object
collectives (outermost call only). Bytes = the payload of this rank's tensor (for all_reduce the buffer size; a
ring all-reduce puts 2(n-1)/n of it on the wire). Each call is attributed to its call site in the library
(innermost library frames), which gives the category.

Analytic minimum (Megatron-style TP without sequence parallelism, A = one activation, microbatch x seq x hidden fp32):
  TP, per microbatch: forward 1 (vocab embedding, first stage) + 2 per layer (after o_proj and down_proj) + 2
      (vocab-parallel cross-entropy: max, then sum-exp and target logit, last stage); backward 2 per layer (input
      grads of the attention and MLP column-parallel regions) + 1 (input grad of the column-parallel lm_head).
  PP, per microbatch and stage boundary: one activation forward, one gradient backward (+ one int64 header per
      link and direction per step, as pipeline/p2p.py's metadata cache sends; the loss broadcast that gives every
      stage the step's loss is not in the minimum).
  DP: one all-reduce of all gradients, in ceil(grad bytes / bucket) buckets (bucket = parallel_module.BUCKET_BYTES).

Run:  python benchmarks/bench_comm.py          (launches torchrun --nproc_per_node=2, then 4)
Writes benchmarks/results/bench_comm.json.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
import traceback
from collections import defaultdict

import _common as C  # sets OMP_NUM_THREADS before torch loads
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

NAME = "bench_comm"
M = 4  # microbatches with pp
LAYOUTS = {2: [("tp=2", 2, 1), ("pp=2, m=4", 1, 2), ("dp=2", 1, 1)], 4: [("tp=2 x pp=2, m=4", 2, 2)]}
LIB = C.ROOT + os.sep
HERE = os.path.abspath(__file__)

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "all_gather_single", "reduce_scatter_single",  # torch >= 2.13's names for the two above
               "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
               "send", "recv", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
P2P = ("isend", "irecv")
HEADERS = "PP: headers (1 int64 per link and direction per step)"


# -- counting -------------------------------------------------------------------------------------------------------
def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _site() -> list:
    """The innermost library frames (outside torch and this benchmark), innermost first."""
    frames = []
    for f in reversed(traceback.extract_stack(limit=40)[:-3]):
        if f.filename.startswith(LIB) and os.path.abspath(f.filename) != HERE and "/benchmarks/" not in f.filename:
            frames.append(f"{os.path.relpath(f.filename, C.ROOT)}:{f.lineno} {f.name}")
            if len(frames) == 4:
                break
    return frames


class Counter:
    """Wraps torch.distributed's communication functions; records calls made while `active`."""

    def __init__(self) -> None:
        self.active = False
        self.records = []
        self._depth = threading.local()
        self._originals = {}

    def _wrap(self, name, fn):
        counter = self

        def wrapper(*args, **kwargs):
            depth = getattr(counter._depth, "d", 0)
            if counter.active and depth == 0:
                counter._record(name, args, kwargs)
            counter._depth.d = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._depth.d = depth
        wrapper.__name__ = fn.__name__
        return wrapper

    def _record(self, name, args, kwargs):
        site = _site()
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs["p2p_op_list"]
            for op in ops:
                self.records.append({"op": "isend" if op.op.__name__ == "isend" else "irecv", "bytes": _nbytes(op.tensor),
                                     "dtype": str(op.tensor.dtype), "peer": op.peer, "group": _gsize(op.group),
                                     "site": site, "batched": True})
            self.records.append({"op": "batch_isend_irecv", "bytes": 0, "ops": len(ops), "site": site})
            return
        if name in ("all_gather", "all_gather_into_tensor", "all_gather_single"):  # this rank's contribution
            tensor = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_tensor"))
        elif name in ("send", "recv", "isend", "irecv", "all_reduce", "broadcast", "reduce"):
            tensor = args[0] if args else kwargs.get("tensor")
        else:
            tensor = args[0] if args else None
        group = kwargs.get("group")
        peer = kwargs.get("dst", kwargs.get("src"))
        self.records.append({"op": name, "bytes": _nbytes(tensor), "dtype": str(getattr(tensor, "dtype", "")),
                             "group": _gsize(group), "group_obj": group, "peer": peer, "site": site, "batched": False})

    def install(self) -> None:
        for name in COLLECTIVES + P2P + ("batch_isend_irecv",):
            if not hasattr(dist, name):  # a name this torch does not have yet
                continue
            fn = getattr(dist, name)
            self._originals[name] = (fn, getattr(c10d, name, None))
            wrapped = self._wrap(name, fn)
            setattr(dist, name, wrapped)
            if name in P2P:  # P2POp checks `op in [isend, irecv]` against c10d's globals
                setattr(c10d, name, wrapped)

    def uninstall(self) -> None:
        for name, (fn, c10d_fn) in self._originals.items():
            setattr(dist, name, fn)
            if name in P2P:
                setattr(c10d, name, c10d_fn)


def _gsize(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


# -- classification and the analytic minimum -----------------------------------------------------------------------
def classify(rec, plugin) -> str:
    site = " ".join(rec["site"])
    op = rec["op"]
    if op in ("isend", "irecv", "send", "recv", "batch_isend_irecv"):
        if op == "batch_isend_irecv":
            return "PP: batch_isend_irecv calls"
        if rec["dtype"] != "torch.float32":
            return HEADERS
        sm = plugin.stage_manager
        peer_stage = sm.stage_ranks.index(rec["peer"])  # with 2 stages prev_rank == next_rank (ring), so compare
        sending = op in ("isend", "send")
        forward = (peer_stage > sm.stage) == sending
        return "PP: activations" if forward else "PP: activation grads"
    if "runtime.py" in site and op == "broadcast":
        return "PP: loss broadcast to every stage"
    if "parallel_module.py" in site and ("sync_grads" in site or " launch" in site):  # launch: during backward
        if rec.get("group_obj") is plugin.dp_group and plugin.dp_size > 1:
            return "DP: gradient all-reduce (buckets)"
        return "PP: tied-weight gradient all-reduce"
    if "loss.py" in site:
        return "TP fwd: vocab-parallel cross-entropy"
    if "comm.py" in site and " backward" in site:
        return "TP bwd: column-parallel input grads"
    if "embedding.py" in site:
        return "TP fwd: vocab embedding"
    if "linear.py" in site and "comm.py" in site:
        return "TP fwd: row-parallel outputs (o_proj, down_proj)"
    return "other: " + (rec["site"][0] if rec["site"] else "(outside the library)")


def minimum(plugin, model_cfg, batch: int, seq: int, grad_bytes: int, bucket_bytes: int):
    """{category: (count, bytes)} this rank needs at least."""
    tp, pp, dp = plugin.tp_size, plugin.pp_size, plugin.dp_size
    m = M if pp > 1 else 1
    mb = batch // m
    act = mb * seq * model_cfg.hidden_size * 4
    out = {}
    if tp > 1:
        first, last = plugin.is_first_stage(), plugin.is_last_stage()
        layers = model_cfg.num_hidden_layers // pp
        tokens = mb * seq
        out["TP fwd: vocab embedding"] = (m, m * act) if first else (0, 0)
        out["TP fwd: row-parallel outputs (o_proj, down_proj)"] = (2 * layers * m, 2 * layers * m * act)
        out["TP fwd: vocab-parallel cross-entropy"] = (2 * m, m * (tokens * 4 + 2 * tokens * 4)) if last else (0, 0)
        out["TP bwd: column-parallel input grads"] = ((2 * layers + last) * m, (2 * layers + last) * m * act)
    if pp > 1:
        first, last = plugin.is_first_stage(), plugin.is_last_stage()
        links = (not first) + (not last)  # neighbours of this stage
        out["PP: activations"] = (m * links, m * links * act)
        out["PP: activation grads"] = (m * links, m * links * act)
        out[HEADERS] = (2 * links, 2 * links * 8)
    if dp > 1:
        n = max(1, math.ceil(grad_bytes / bucket_bytes))
        out["DP: gradient all-reduce (buckets)"] = (n, grad_bytes)
    return out


# -- worker: one torchrun ----------------------------------------------------------------------------------------
def worker(out_path: str) -> None:
    from booster_plugin import Booster, HybridParallelPlugin
    from booster_plugin.core.grad_bucket import BUCKET_BYTES

    rank = C.init_dist(world_size=None)
    world = dist.get_world_size()
    reference = C.build_llama(seed=0)
    batch = C.make_batches(1)[0]
    counter = Counter()
    counter.install()
    results = {}
    for label, tp, pp in LAYOUTS[world]:
        plugin = HybridParallelPlugin(tp_size=tp, pp_size=pp, num_microbatches=M if pp > 1 else None)
        booster = Booster(plugin=plugin)
        model, opt = C.boost_copy(booster, reference)

        def step():
            if pp > 1:
                booster.execute_pipeline(iter([batch]), model, C.hf_criterion, opt, return_loss=True)
            else:
                booster.backward(model(**batch).loss, opt)
            opt.step()
            opt.zero_grad()

        step()  # warm-up (the pipeline's metadata exchange happens here)
        dist.barrier()
        counter.records.clear()
        counter.active = True
        step()
        counter.active = False
        dist.barrier()
        grad_bytes = sum(p.numel() * p.element_size() for p in model.unwrap().parameters() if p.requires_grad)
        measured = defaultdict(lambda: {"count": 0, "bytes": 0, "sites": defaultdict(int)})
        for rec in counter.records:
            cat = classify(rec, plugin)
            measured[cat]["count"] += 1
            measured[cat]["bytes"] += rec["bytes"]
            measured[cat]["sites"][" <- ".join(rec["site"][:2])] += 1
        mins = minimum(plugin, reference.config, C.BATCH, C.SEQ, grad_bytes, BUCKET_BYTES)
        local = {"stage": plugin.stage, "tp_rank": plugin.tp_rank, "dp_rank": plugin.dp_rank,
                 "measured": {k: {"count": v["count"], "bytes": v["bytes"], "sites": dict(v["sites"])}
                              for k, v in measured.items()},
                 "minimum": {k: {"count": c, "bytes": b} for k, (c, b) in mins.items()},
                 "grad_bytes": grad_bytes}
        results[label] = {"tp": tp, "pp": pp, "dp": plugin.dp_size, "microbatches": M if pp > 1 else 1,
                          "per_rank": C.gather_per_rank(local)}
        del model, opt, booster, plugin
    counter.uninstall()
    C.worker_done(rank, out_path, results)


# -- driver -------------------------------------------------------------------------------------------------------
def size(b: float) -> str:
    if b < 1024:
        return f"{b:.0f} B"
    if b < 2 ** 20:
        return f"{b / 1024:.1f} KiB"
    return f"{b / 2 ** 20:.2f} MiB"


def report(all_results, t_start: float) -> None:
    """Ranks of a layout with identical numbers in a category share one row."""
    rows, summary, flags = [], [], []
    for label, res in all_results.items():
        per_rank = res["per_rank"]
        cats = list(dict.fromkeys(c for pr in per_rank for c in list(pr["minimum"]) + list(pr["measured"])))
        for cat in cats:
            groups = {}
            for r, pr in enumerate(per_rank):
                me = pr["measured"].get(cat, {"count": 0, "bytes": 0, "sites": {}})
                mi = pr["minimum"].get(cat, {"count": 0, "bytes": 0})
                if me["count"] == 0 and mi["count"] == 0:
                    continue
                key = (me["count"], mi["count"], me["bytes"], mi["bytes"])
                groups.setdefault(key, {"ranks": [], "sites": me["sites"]})["ranks"].append(r)
            for (mc, ic, mb, ib), g in groups.items():
                ranks = ",".join(f"r{r}" for r in g["ranks"])
                stages = ",".join(sorted({str(per_rank[r]["stage"]) for r in g["ranks"]}))
                note = ""
                if cat == "PP: batch_isend_irecv calls":
                    note = "calls that carry the messages above (not in totals)"
                elif mc > ic or mb > ib * 1.001:
                    sites = "; ".join(f"{s} x{n}" for s, n in g["sites"].items())
                    note = "EXCESS from " + sites
                    flags.append(f"{label} {ranks}: {cat}: {mc} x / {size(mb)} measured vs {ic} x / {size(ib)} "
                                 f"minimum, from {sites}")
                elif mc < ic:
                    note = "below the minimum?"
                rows.append([label, f"{ranks} (stage {stages})", cat, mc, ic, size(mb), size(ib), note])
        for r, pr in enumerate(per_rank):
            tot = [0, 0, 0, 0]
            for cat in set(pr["measured"]) | set(pr["minimum"]):
                if cat == "PP: batch_isend_irecv calls":
                    continue
                me = pr["measured"].get(cat, {"count": 0, "bytes": 0})
                mi = pr["minimum"].get(cat, {"count": 0, "bytes": 0})
                tot = [tot[0] + me["count"], tot[1] + mi["count"], tot[2] + me["bytes"], tot[3] + mi["bytes"]]
            summary.append([label, f"r{r} (stage {pr['stage']}, tp {pr['tp_rank']}, dp {pr['dp_rank']})",
                            tot[0], tot[1], size(tot[2]), size(tot[3]), f"{tot[2] / tot[3]:.6f}" if tot[3] else "-"])
    print(f"\nCommunication per training step per rank, measured vs analytic minimum; Llama h{C.HIDDEN} "
          f"L{C.LAYERS} vocab {C.VOCAB}, seq {C.SEQ}, batch {C.BATCH} per rank, fp32; pp: m={M} microbatches; "
          f"bytes = payload per rank")
    print(C.table(["layout", "ranks", "category", "measured #", "min #", "measured bytes", "min bytes", "note"], rows))
    print("\nTotals per rank (collectives + P2P messages):")
    print(C.table(["layout", "rank", "measured #", "min #", "measured bytes", "min bytes", "bytes measured/min"],
                  summary))
    print("\nExcess over the minimum: " + ("none" if not flags else ""))
    for f in flags:
        print("  - " + f)
    out = {"benchmark": NAME, "model": {"hidden": C.HIDDEN, "layers": C.LAYERS, "heads": C.HEADS, "vocab": C.VOCAB,
                                        "seq": C.SEQ, "batch_per_rank": C.BATCH, "intermediate": C.INTERMEDIATE,
                                        "microbatches_with_pp": M, "dtype": "fp32", "optimizer": "AdamW"},
           "env": {"torch": torch.__version__, "backend": "gloo", "cpu_count": os.cpu_count(),
                   "loadavg_at_end": C.loadavg()},
           "layouts": all_results, "excess": flags, "total_s": time.perf_counter() - t_start}
    print("wrote " + C.write_results(NAME, out))


def main() -> None:
    C.worker_main(HERE, LAYOUTS, worker, report)


if __name__ == "__main__":
    main()
