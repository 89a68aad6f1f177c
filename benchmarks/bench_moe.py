"""Expert parallelism (ep=2) vs experts tensor-split (tp=2) vs one process: training tokens/s of a Qwen3-MoE-like
model on 2 gloo/CPU ranks (one thread each), the same global batch for every layout, plus expert parameter bytes
per rank and the all-to-all bytes of ep against the minimum the routing allows.

Model: transformers' Qwen3MoeForCausalLM from a config (random init, seed 0): hidden 256, 4 layers, every layer MoE
(normalized top-k weights), 4 heads / 2 kv heads of 64, vocab 1024, seq 256, global batch 16 (4096 tokens), fp32,
AdamW(lr=1e-3), no router aux loss (output_router_logits=False: the loss is the plain LM loss, so every layout's loss
equals one process's and the losses can be compared), transformers' default experts implementation (grouped_mm: on
CPU one matmul per expert). Three expert shapes, run one after the other (--configs); the first two have the same
expert FLOPs per token (top_k x moe_intermediate = 1024):
  coarse  8 experts, top-2, moe_intermediate 512 (the issue's shape; experts ~2/3 of a one-process step);
  fine    128 experts, top-8, moe_intermediate 128 (Qwen3-MoE's own expert count and top-k, as Qwen3-30B-A3B);
  a3b     128 experts, top-8, moe_intermediate 96: Qwen3-30B-A3B's expert shape scaled down with the hidden size
          (2048 -> 256, 768 -> 96; expert FLOPs per token 768).
Under tp=2 every rank runs every expert at half width on every token (its gathers, routing-weight products and
scatters over all token x top-k pairs are not split); under ep=2 a rank runs half the experts at full width on the
pairs routed to them. With many narrow experts that duplicated per-pair work and the doubled number of per-expert
matmuls make tp slower (the more so the narrower the experts: 48 features per tp rank in a3b); with 8 wide experts
tp and ep cost about the same CPU time, and ep pays for routing imbalance (4 experts per rank: the busier rank gets
~52-60% of the pairs at this random init) at every all-to-all.

Layouts, in ONE run, interleaved in rounds with a rotating order (median of the timed steps after a warm-up):
  one process         rank 0 trains the whole global batch alone while rank 1 waits at the barrier: what one
                      process (one core) delivers. This is the baseline of the speedups.
  one process x2      both ranks train a full copy on the whole global batch (redundant work, no communication):
                      what one process delivers while the other core is busy too (shows core contention on this
                      shared machine; informational, not a baseline).
  tp=2                HybridParallelPlugin(tp_size=2): attention and every expert split over tp (moe_tp_experts:
                      each rank holds half of every expert's intermediate features), both ranks run the whole batch.
  ep=2                HybridParallelPlugin(ep_size=2): dp=2 = ep 2, each rank trains half the global batch, holds
                      4 of the 8 experts whole, tokens travel to their experts by all-to-all (dropless) and back.
  dp=2                HybridParallelPlugin() on 2 ranks: each rank trains half the global batch with EVERY expert
                      (replicated, no all-to-all; gradients averaged over dp). It does ep=2's compute with none of
                      its exchanges, and needs all experts on each rank: the ceiling of ep=2's speed on this
                      machine (ep_over_dp <= 1), so dp_over_tp bounds what ep_over_tp can reach here.
tokens/s = global batch tokens / step wall time (barrier to barrier) for every layout: the whole job's throughput.

Checked and reported:
  - the losses of all layouts agree at every step (the same weights, the same batches);
  - expert parameter bytes per rank: the parameters of every layer's `mlp.experts` module on each rank, against one
    process's (must be exactly 1/ep for ep, 1/tp for tp);
  - all-to-all bytes per ep step from shardformer.expert.dispatch.TRAFFIC (token activations sent to the
    other rank by dispatch and combine, forward and backward, summed over ranks) against the minimum computed from
    the routing alone, independently of the exchange's code: for every MoE layer and token, the number of distinct
    ranks other than the token's own among the ranks holding its top-k experts (expert e lives on rank
    e // (E / ep); tokens of global batch rows [r*B/ep, (r+1)*B/ep) live on rank r), times hidden size times 4
    bytes (fp32), times 4 (dispatch + combine, forward + backward). Two routings are used: (a) the one-process
    model's router outputs on the same batch at the same step (its own copy, trained in lockstep), recorded by a
    pre-hook on its experts modules; (b) the ep model's own router outputs (a hook on each layer's `mlp.gate`).
    (a) may differ from (b) by the odd token whose top-2 is a near tie that fp32 rounding of the lockstep weights
    flips; TRAFFIC must equal (b) exactly.

Timing on this shared 2-core machine: every layout is timed barrier to barrier on wall clock (tokens/s); the table
also gives each rank's CPU time per step (process_time), which leaves out waiting (for the peer at a collective, or
for a core other work holds), and the ratios give the paired median over rounds, the ratio of minima (the
least-disturbed steps) and the ratio of the busiest rank's median CPU time (what the layouts would deliver with a
core of their own each). `one process x2` / `one process` shows how much two busy processes slow each other here.

Run:  OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 benchmarks/bench_moe.py [--rounds N] [--batch B]
                                  [--configs coarse,fine,a3b] [--quick]
Writes benchmarks/results/moe.json.
"""
from __future__ import annotations

import argparse
import copy
import time
from typing import Dict, List

import _common as C  # sets OMP_NUM_THREADS before torch loads
import torch
import torch.distributed as dist

from booster_plugin import Booster, HybridParallelPlugin
from shardformer.expert import dispatch as EP

NAME = "moe"
WORLD = 2
HIDDEN, LAYERS, EXPERTS, TOP_K, MOE_INTERMEDIATE = 256, 4, 8, 2, 512
HEADS, KV_HEADS, HEAD_DIM, VOCAB, SEQ = 4, 2, 64, 1024, 256
SINGLE, SINGLE_BOTH, TP, DP, EPV = "one process", "one process x2", "tp=2", "dp=2", "ep=2"
ELEMENT = 4  # fp32 bytes


def build_reference(layers: int, experts: int = EXPERTS, top_k: int = TOP_K, moe_intermediate: int = MOE_INTERMEDIATE,
                    seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * moe_intermediate,
                            moe_intermediate_size=moe_intermediate, num_hidden_layers=layers,
                            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                            num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=SEQ,
                            tie_word_embeddings=False, pad_token_id=0, output_router_logits=False,
                            attention_dropout=0.0)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    model.train()
    return model


def moe_layers(model) -> List[torch.nn.Module]:
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def expert_bytes(model) -> int:
    """Bytes of the parameters of every MoE layer's experts module (routed experts; the router is not counted)."""
    return sum(p.numel() * p.element_size() for mlp in moe_layers(model) for p in mlp.experts.parameters())


def all_param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class A2ATimer:
    """Wall seconds this rank spends inside dist.all_to_all_single (the ep exchanges: waiting for the peer
    included), per step."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._original = dist.all_to_all_single

    def install(self) -> None:
        original = self._original

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        dist.all_to_all_single = timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


# -- the layouts ----------------------------------------------------------------------------------------------------
def build_single(reference, on_this_rank: bool, routing: List | None = None):
    """One process on the whole global batch (on this rank only if `on_this_rank`). `routing`: a list that gets, per
    step, the top-k expert indices each MoE layer's experts module received ([tokens, k], tokens in batch order)."""
    if not on_this_rank:
        return (lambda batch: None), None
    model = copy.deepcopy(reference)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    current: List[torch.Tensor] = []
    if routing is not None:
        for mlp in moe_layers(model):
            mlp.experts.register_forward_pre_hook(lambda mod, args: current.append(args[1].detach()))

    def step(batch):
        current.clear()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if routing is not None:
            routing.append(list(current))
        return loss.item()
    return step, model


def build_tp(reference):
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2))
    model, opt = C.boost_copy(booster, reference)

    def step(batch):
        loss = model(**batch).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        return loss.item()
    return step, model


def build_ep(reference, traffic: List[Dict], timer: A2ATimer, ep_size: int = 2):
    """ep=2, or with ep_size=1 plain dp=2 (every expert on every rank, no exchange: the ceiling of ep=2's speed)."""
    plugin = HybridParallelPlugin(ep_size=ep_size)
    booster = Booster(plugin=plugin)
    model, opt = C.boost_copy(booster, reference)
    rank, ep = plugin.dp_rank, plugin.dp_size
    current: List[torch.Tensor] = []
    for mlp in moe_layers(model.unwrap()) if ep_size > 1 else ():  # the router's own top-k indices (Qwen3MoeTopKRouter returns
        # (logits, weights, indices)): the routing the ep model used, recorded apart from the exchange's code
        mlp.gate.register_forward_hook(lambda mod, args, out: current.append(out[2].detach()))

    def step(batch):
        size = next(iter(batch.values())).shape[0] // ep
        local = {k: v[rank * size:(rank + 1) * size] for k, v in batch.items()}
        current.clear()
        EP.TRAFFIC.reset()
        timer.reset()
        loss = model(**local).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        traffic.append({"bytes": EP.TRAFFIC.bytes_sent, "rows": EP.TRAFFIC.rows_sent, "a2a_s": timer.seconds,
                        "a2a_calls": timer.calls, "routing": list(current)})
        return loss.item()
    return step, model, plugin


# -- the analytic minimum -------------------------------------------------------------------------------------------
def remote_ranks(index: torch.Tensor, token_rank: torch.Tensor, ep: int, experts: int) -> int:
    """Sum over tokens of the number of distinct ranks, other than the token's own, holding its top-k experts."""
    dest = index // (experts // ep)                                   # [T, K] rank of each choice
    hits = torch.stack([(dest == r).any(-1) & (token_rank != r) for r in range(ep)])  # [ep, T]
    return int(hits.sum())


def minimum_rows(layer_indices: List[torch.Tensor], token_rank: torch.Tensor, ep: int, experts: int) -> int:
    return sum(remote_ranks(idx, token_rank, ep, experts) for idx in layer_indices)


def pairs_per_rank(layer_indices: List[torch.Tensor], ep: int, experts: int) -> List[int]:
    """(token, expert) pairs each rank's experts compute in a step (load balance of the routing)."""
    out = [0] * ep
    for idx in layer_indices:
        dest = idx // (experts // ep)
        for r in range(ep):
            out[r] += int((dest == r).sum())
    return out


CONFIGS = {  # name: (experts, top_k, moe_intermediate); expert compute per token is the same (top_k x moe_intermediate)
    "coarse": (8, 2, 512),     # the shape: few wide experts
    "fine": (128, 8, 128),     # Qwen3-MoE's own expert count and top-k (Qwen3-30B-A3B: 128 experts, top-8)
    "a3b": (128, 8, 96),       # Qwen3-30B-A3B's expert shape scaled with hidden 2048 -> 256 (moe_intermediate 768 / 8)
}


def run_config(name: str, experts: int, top_k: int, moe_intermediate: int, args, rank: int, dog, say,
               timer: "A2ATimer") -> Dict:
    """Every layout of one model shape, interleaved; returns its results (printed on rank 0)."""
    ep = WORLD
    out = {"model": {"family": "Qwen3MoeForCausalLM", "hidden": HIDDEN, "layers": args.layers, "experts": experts,
                     "top_k": top_k, "moe_intermediate": moe_intermediate, "heads": HEADS, "kv_heads": KV_HEADS,
                     "head_dim": HEAD_DIM, "vocab": VOCAB, "seq": SEQ, "global_batch": args.batch, "dtype": "fp32",
                     "optimizer": "AdamW(lr=1e-3)", "router_aux_loss": False}}
    reference = build_reference(args.layers, experts, top_k, moe_intermediate)
    experts_impl = reference.config._experts_implementation
    batches = C.make_batches(4, batch=args.batch, seq=SEQ, vocab=VOCAB)
    single_routing: List[List[torch.Tensor]] = []
    ep_traffic: List[Dict] = []
    dog.arm(f"{name}: building the layouts", 300)
    single_step, _ = build_single(reference, rank == 0, single_routing)
    single_both_step, _ = build_single(reference, True)
    tp_step, tp_model = build_tp(reference)
    ep_step, ep_model, _ = build_ep(reference, ep_traffic, timer)
    dp_step, _, _ = build_ep(reference, [], timer, ep_size=1)
    dog.disarm()
    steps = {SINGLE: single_step, SINGLE_BOTH: single_both_step, TP: tp_step, DP: dp_step, EPV: ep_step}
    names = list(steps)

    def forget_warmup():  # traffic and routing of the timed steps only
        ep_traffic.clear()
        single_routing.clear()
    times, cpu, losses = C.interleaved_steps(steps, batches, args.rounds, dog, after_warmup=forget_warmup)

    # -- losses: every layout the same model on the same batches --------------------------------------------------
    gathered = C.gather_per_rank(losses)
    per_step = {}
    for n in names:
        if n in (EPV, DP):  # each rank has its half's loss: the global loss is their mean (equal label tokens)
            per_step[n] = [sum(g[n][s] for g in gathered) / WORLD for s in range(len(losses[n]))]
        else:
            per_step[n] = [next(g[n][s] for g in gathered if g[n][s] is not None) for s in range(len(losses[n]))]
    loss_spread = max(max(per_step[n][s] for n in names) - min(per_step[n][s] for n in names)
                      for s in range(len(per_step[SINGLE])))

    # -- expert parameter bytes ---------------------------------------------------------------------------------
    full_experts, full_all = expert_bytes(reference), all_param_bytes(reference)
    per_rank_bytes = C.gather_per_rank({TP: (expert_bytes(tp_model.unwrap()), all_param_bytes(tp_model.unwrap())),
                                        EPV: (expert_bytes(ep_model.unwrap()), all_param_bytes(ep_model.unwrap()))})

    # -- all-to-all bytes vs the minimum --------------------------------------------------------------------------
    tokens = args.batch * SEQ
    token_rank = torch.arange(tokens) // SEQ // (args.batch // ep)  # rank holding each token of the global batch
    ep_ranks = C.gather_per_rank([{k: v for k, v in t.items() if k != "routing"} for t in ep_traffic])
    ep_routing = C.gather_per_rank([t["routing"] for t in ep_traffic])  # per rank, per step, per layer: [T/ep, K]
    steps_timed = len(ep_traffic)
    measured = [sum(ep_ranks[r][s]["bytes"] for r in range(WORLD)) for s in range(steps_timed)]
    measured_rows = [sum(ep_ranks[r][s]["rows"] for r in range(WORLD)) for s in range(steps_timed)]
    own_rows, own_pairs, ep_layers = [], [], []
    for s in range(steps_timed):  # the ep model's routing, its ranks' halves in batch order
        layers_idx = [torch.cat([ep_routing[r][s][l] for r in range(WORLD)]) for l in range(len(ep_routing[0][s]))]
        ep_layers.append(layers_idx)
        own_rows.append(minimum_rows(layers_idx, token_rank, ep, experts))
        own_pairs.append(pairs_per_rank(layers_idx, ep, experts))
    row_bytes = HIDDEN * ELEMENT * 4  # dispatch + combine, forward + backward
    if rank == 0:
        single_rows = [minimum_rows(r, token_rank, ep, experts) for r in single_routing]
        flips = [sum(int((a.sort(-1).values != b.sort(-1).values).any(-1).sum()) for a, b in
                     zip(single_routing[s], ep_layers[s])) for s in range(steps_timed)]
    else:
        single_rows, flips = [], []
    single_rows, flips = C.gather_per_rank((single_rows, flips))[0]
    min_own = [r * row_bytes for r in own_rows]
    min_single = [r * row_bytes for r in single_rows]
    pairs_total = [sum(p) for p in own_pairs]
    traffic = {
        "per_step_measured_bytes": measured, "per_step_measured_rows": measured_rows,
        "per_step_min_bytes_from_ep_router": min_own, "per_step_min_bytes_from_one_process_router": min_single,
        "per_step_tokens_routed_differently_one_process_vs_ep": flips,
        "equal_to_minimum_every_step_ep_router": measured == min_own,
        "rows_equal_every_step": measured_rows == own_rows,
        "equal_to_minimum_one_process_router_steps": sum(a == b for a, b in zip(measured, min_single)),
        "max_abs_diff_vs_one_process_router_bytes": max((abs(a - b) for a, b in zip(measured, min_single)),
                                                        default=0),
        "all_to_all_ms_median_per_rank": [C.median([t["a2a_s"] * 1e3 for t in ep_ranks[r]]) for r in range(WORLD)],
        "all_to_all_calls_per_step": ep_ranks[0][0]["a2a_calls"] if steps_timed else 0,
        "expert_pairs_per_rank_per_step": own_pairs,
        "busiest_rank_pairs_over_mean_median": C.median([max(p) * ep / t for p, t in zip(own_pairs, pairs_total)]),
        "bytes_if_every_token_went_to_every_other_rank": tokens * (ep - 1) * len(moe_layers(reference)) * row_bytes,
    }

    # -- timing ---------------------------------------------------------------------------------------------------
    cpu_ranks = C.gather_per_rank(cpu)
    med = {n: C.median(times[n]) for n in names}
    tps = {n: tokens / med[n] for n in names}
    speed = lambda a, b: C.paired_ratio(times[b], times[a])  # noqa: E731  tokens/s of a over b, paired by round
    busiest_cpu = {n: max(C.median(cpu_ranks[r][n]) for r in range(WORLD)) for n in names}
    ratios = {"ep_over_tp": speed(EPV, TP), "ep_over_one_process": speed(EPV, SINGLE),
              "tp_over_one_process": speed(TP, SINGLE), "ep_over_tp_min": min(times[TP]) / min(times[EPV]),
              "ep_over_one_process_min": min(times[SINGLE]) / min(times[EPV]),
              "ep_over_tp_busiest_rank_cpu": busiest_cpu[TP] / busiest_cpu[EPV],
              "ep_over_one_process_busiest_rank_cpu": busiest_cpu[SINGLE] / busiest_cpu[EPV],
              "one_process_x2_over_one_process": speed(SINGLE_BOTH, SINGLE),
              "ep_over_dp": speed(EPV, DP), "dp_over_tp": speed(DP, TP)}  # dp=2: ep's ceiling (no exchange)
    targets = {"ep_over_tp >= 1.3": ratios["ep_over_tp"] >= 1.3,
               "ep_over_one_process >= 1.5": ratios["ep_over_one_process"] >= 1.5,
               "expert bytes per rank == 1/ep": all(b[EPV][0] * ep == full_experts for b in per_rank_bytes),
               "all-to-all bytes == minimum (ep router)": traffic["equal_to_minimum_every_step_ep_router"]}
    out.update({
        "experts_implementation": experts_impl,
        "variants": [{"name": n, "median_ms": med[n] * 1e3, "min_ms": min(times[n]) * 1e3, "tokens_per_s": tps[n],
                      "samples_ms": [t * 1e3 for t in times[n]],
                      "cpu_ms_median_per_rank": [C.median(cpu_ranks[r][n]) * 1e3 for r in range(WORLD)]}
                     for n in names],
        "ratios": ratios, "targets_met": targets, "losses_per_step": per_step, "max_loss_spread_any_step": loss_spread,
        "expert_bytes": {"one_process": full_experts, "all_params_one_process": full_all,
                         "per_rank": {n: [b[n][0] for b in per_rank_bytes] for n in (TP, EPV)},
                         "all_params_per_rank": {n: [b[n][1] for b in per_rank_bytes] for n in (TP, EPV)}},
        "traffic": traffic,
    })

    say(f"\n== {name}: Qwen3-MoE h{HIDDEN} L{args.layers}, {experts} experts top-{top_k} moe_intermediate "
        f"{moe_intermediate}, vocab {VOCAB}, seq {SEQ}, global batch {args.batch} ({tokens} tokens), fp32, AdamW, "
        f"experts '{experts_impl}', 2 gloo ranks x 1 thread; median of {args.rounds} interleaved steps")
    rows = [[n, f"{med[n] * 1e3:.0f}", f"{min(times[n]) * 1e3:.0f}", f"{tps[n]:.0f}",
             f"{speed(n, SINGLE):.2f}", f"{speed(n, TP):.2f}",
             " / ".join(f"{C.median(cpu_ranks[r][n]) * 1e3:.0f}" for r in range(WORLD)), f"{per_step[n][0]:.5f}"]
            for n in names]
    say(C.table(["layout", "median ms", "min ms", "tokens/s", "x one process", "x tp=2", "CPU ms r0 / r1",
                 "loss step 1"], rows))
    say(f"losses agree across layouts at every step within {loss_spread:.2e}")
    say(f"expert parameter bytes per rank (mlp.experts of {len(moe_layers(reference))} layers): one process "
        f"{full_experts:,}; tp=2 " + " / ".join(f"{b[TP][0]:,}" for b in per_rank_bytes) + "; ep=2 "
        + " / ".join(f"{b[EPV][0]:,}" for b in per_rank_bytes)
        + f" (x{ep} = {per_rank_bytes[0][EPV][0] * ep:,}: "
        + ("exactly 1/ep" if targets["expert bytes per rank == 1/ep"] else "NOT 1/ep") + ")")
    say(f"all parameter bytes per rank: one process {full_all:,}; tp=2 "
        + " / ".join(f"{b[TP][1]:,}" for b in per_rank_bytes) + "; ep=2 "
        + " / ".join(f"{b[EPV][1]:,}" for b in per_rank_bytes))
    if steps_timed:
        say(f"all-to-all bytes per ep step (TRAFFIC, both ranks) vs minimum from the routing "
            f"(rows x {HIDDEN} x {ELEMENT} B x 4):")
        say(C.table(["step", "TRAFFIC bytes", "min (ep router)", "min (one-process router)", "tokens routed apart",
                     "a2a ms r0 / r1", "expert pairs r0 / r1"],
                    [[s + 1, f"{measured[s]:,}", f"{min_own[s]:,}", f"{min_single[s]:,}", flips[s],
                      " / ".join(f"{ep_ranks[r][s]['a2a_s'] * 1e3:.0f}" for r in range(WORLD)),
                      " / ".join(str(p) for p in own_pairs[s])] for s in range(steps_timed)]))
        say(f"TRAFFIC == minimum (ep router) at every step: {traffic['equal_to_minimum_every_step_ep_router']}; "
            f"== minimum (one-process router) at {traffic['equal_to_minimum_one_process_router_steps']} of "
            f"{steps_timed} steps (max difference {traffic['max_abs_diff_vs_one_process_router_bytes']:,} B); "
            f"every token to the other rank would be {traffic['bytes_if_every_token_went_to_every_other_rank']:,}")
    say("ratios (tokens/s; paired median over rounds, ratio of minima, busiest rank's CPU time): "
        + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    say("targets: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in targets.items()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10, help="interleaved timed rounds")
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences of 256 tokens)")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"model shapes to run, of {list(CONFIGS)}")
    parser.add_argument("--name", default=NAME, help="results file benchmarks/results/NAME.json")
    parser.add_argument("--quick", action="store_true", help="2 rounds, batch 4, to check that it runs")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.batch = 2, 4
    rank = C.init_dist(timeout_s=300.0, world_size=WORLD)
    results = {"benchmark": NAME, "env": C.environment(), "hung": [], "rounds": args.rounds, "configs": {}}
    dog = C.Watchdog(args.name, results)
    say = C.rank0_printer(rank)
    t_start = time.perf_counter()
    timer = A2ATimer()
    timer.install()
    for name in args.configs.split(","):
        results["configs"][name] = run_config(name, *CONFIGS[name], args, rank, dog, say, timer)
    C.finish(args.name, results, rank, t_start, say, "180 s per step")


if __name__ == "__main__":
    main()
