import sys, time, collections
import torch
from tests import model_utils as mu
from tests.dist_utils import run_distributed

CONFIGS = {
 "tp2": ("llama_lm", dict(tp_size=2)),
 "one": ("llama_lm", dict()),
 "sp_split": ("llama_lm", dict(tp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather")),
 "sp_ring": ("llama_lm", dict(sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="ring_attn")),
 "sp_a2a": ("llama_lm", dict(sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all")),
 "ep2": ("qwen3moe_lm", dict(ep_size=2)),
 "tp2pp2": ("llama_lm", dict(tp_size=2, pp_size=2, num_microbatches=2)),
}

def _cases(names):
    import torch.distributed as dist
    for name in names:
        kind, kw = CONFIGS[name]
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        t = time.time()
        mu.check_training(kind, layers=2, steps=2, compile_layers=True, **kw)
        c = torch._dynamo.utils.counters
        if dist.get_rank() == 0:
            print(f"== {name}: {time.time()-t:.1f}s graphs={c['stats']['unique_graphs']} breaks={sum(c['graph_break'].values())}", flush=True)
            for k, v in c["graph_break"].items():
                print("   ", v, k[:300].replace("\n", " "), flush=True)

def test_probe():
    names = sys.argv[1:] if False else __import__("os").environ["PROBE"].split(",")
    n = 1 if names == ["one"] else (4 if "tp2pp2" in names else 2)
    run_distributed(n, _cases, names)
