"""The scenarios of benchmarks/faults.py: one bad input or fault each, as a short script every rank runs.

A scenario's `source` is the body of `main()`; PRELUDE gives it `boost(...)`, `step(...)`, `batch(...)`, `ok(...)`,
`note(...)`, `fault()` (prints the wall-clock moment the fault is injected), RANK and DIR (a directory the ranks of
one run share). `match` maps a rank (-1: every rank) to a regex the rank's outcome ("Type: full message", "ok ...",
or what the runner saw: "stopping: ...", "killed by SIGKILL", "exit 1 (no OUTCOME line)") must match; `within`
bounds the seconds from the fault (or the start) to the last rank's exit."""
from __future__ import annotations

import textwrap
from typing import Dict, NamedTuple, Optional, Tuple


class Scenario(NamedTuple):
    name: str                       # "1", "21a", ...
    fault: str                      # the input or fault, as the table says it
    ranks: int
    source: str                     # body of main(); "" with `command`
    expect: str                     # what should happen now, in words
    match: Dict[int, str] = {}      # rank (-1: all) -> regex on its outcome
    within: Optional[float] = None  # seconds from fault (or start) to the last exit
    command: Tuple[str, ...] = ()   # run this (python -m ...) once instead of `source` on `ranks` ranks
    limit: float = 300.0            # the runner kills every rank after this many seconds


PRELUDE = '''
import errno, os, signal, sys, time, traceback, warnings
import torch
import torch.distributed as dist
torch.set_num_threads(1)
from booster_plugin import Booster, HybridParallelPlugin
from tests import model_utils as mu
RANK, DIR = int(os.environ["RANK"]), os.environ["FAULT_DIR"]

def ok(detail=""):
    print(f"OUTCOME: ok {detail}", flush=True)

def note(text):
    print(f"NOTE: {text}", flush=True)

def fault():
    print(f"FAULT: {time.time():.3f}", flush=True)

def batch(kind="gpt2_lm", size=4, seed=0):
    return mu.make_batch(kind, size, seed)

def boost(kind="gpt2_lm", layers=4, optimizer=True, model=None, **plugin_kwargs):
    booster = Booster(plugin=HybridParallelPlugin(**plugin_kwargs))
    model = mu.build(kind, layers) if model is None else model
    if optimizer is True:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif callable(optimizer):
        optimizer = optimizer(model)
    model, optimizer, *_ = booster.boost(model, optimizer or None)
    return booster, model, optimizer

def step(booster, model, optimizer, data, criterion=mu.criterion):
    return booster.execute_pipeline(iter([data]), model, criterion, optimizer, return_loss=True)

def train(booster, model, optimizer, data, criterion=mu.criterion):
    out = step(booster, model, optimizer, data, criterion)
    optimizer.step()
    optimizer.zero_grad()
    return float(out["loss"])

def main():
'''

EPILOGUE = '''
try:
    main()
except BaseException as error:
    text = str(error)
    print(f"OUTCOME: {type(error).__name__}: {text.splitlines()[0] if text else ''}", flush=True)
    print("DETAIL: " + " | ".join(text.splitlines())[:3000], flush=True)
    traceback.print_exc()
    sys.stdout.flush(); sys.stderr.flush()
    sys.exit(1)
'''


def script(source: str) -> str:
    return PRELUDE + textwrap.indent(textwrap.dedent(source).strip() + "\n", "    ") + EPILOGUE


PP2 = "pp_size=2, num_microbatches=2"
S = Scenario
SCENARIOS = [
    S("1", "`model.unwrap().generate(...)` under pp=2", 2, f"""
        booster, model, opt = boost({PP2})
        out = model.unwrap().generate(batch()["input_ids"][:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
        ok(f"generated {{out.tolist()}}")""",
      "ok: both ranks generate the same tokens (one pipelined forward per token)", {-1: r"^ok generated \[\["}),
    S("2", "`model(**batch)` in train mode under pp=2", 2, f"""
        booster, model, opt = boost({PP2})
        model(**batch())
        ok("called")""",
      "PipelineCallError on both ranks naming execute_pipeline", {-1: r"^PipelineCallError: .*execute_pipeline"}),
    S("3", "execute_pipeline after `model.eval()`, no `no_grad`, no optimizer (pp=2)", 2, f"""
        booster, model, _ = boost({PP2}, optimizer=False)
        model.eval()
        out = booster.execute_pipeline(iter([batch()]), model, mu.criterion, return_outputs=True)
        n = sum(p.grad is not None for p in model.unwrap().parameters())
        ok(f"forwards only: {{n}} parameters have .grad, loss {{float(out['loss']):.4f}}")""",
      "forwards only: no parameter has .grad", {-1: r"^ok forwards only: 0 parameters"}),
    S("4", "tp=2 boost after `torch.manual_seed(0)`: is the script's RNG touched?", 2, """
        model = mu.build("gpt2_lm")
        torch.manual_seed(0)
        expected = torch.rand(1)
        torch.manual_seed(0)
        booster, model, opt = boost(model=model, tp_size=2)
        got = torch.rand(1)
        if not torch.equal(got, expected):
            raise AssertionError(f"torch.rand(1) after boost is {got.item()}, without boost {expected.item()}")
        ok(f"RNG untouched (torch.rand(1) = {got.item():.6f} as without boost)")""",
      "ok, RNG untouched", {-1: r"^ok RNG untouched"}),
    S("5", "fp16 (pp=2, initial_scale=2, min_scale=1), an inf loss (so inf/nan gradients) every step", 2, f"""
        booster, model, opt = boost({PP2}, precision="fp16", initial_scale=2, min_scale=1)
        warned = 0
        try:
            for n in range(1, 21):
                step(booster, model, opt, batch(seed=n), lambda out, b: out.loss * float("inf"))
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    opt.step()
                warned += sum("fp16" in str(w.message) for w in caught)
                opt.zero_grad()
        finally:
            note(f"{{warned}} fp16 warnings on this rank before the outcome (step {{n}})")
        ok("no error after 20 steps")""",
      "warnings, then FloatingPointError at min_scale after 5 steps in a row, on both ranks",
      {-1: r"^FloatingPointError: .*min_scale.*5 steps in a row"}),
    S("6", "an optimizer built after boost from `model.parameters()` and stepped (pp=2, GPT-2 tied)", 2, f"""
        booster, model, opt = boost({PP2})
        rogue = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step(booster, model, opt, batch())
        rogue.step()
        ok("the rogue optimizer stepped")""",
      "RuntimeError 'did not go through booster.boost' on both ranks",
      {-1: r"^RuntimeError: .*did not go through booster\.boost"}),
    S("7", "load_optimizer into one AdamW group mixing the saved groups (different lr/decay), pp=2", 2, f"""
        def two_groups(m):
            decay = [p for n, p in m.named_parameters() if n.endswith("weight") and "ln_" not in n]
            rest = [p for n, p in m.named_parameters() if not (n.endswith("weight") and "ln_" not in n)]
            return torch.optim.AdamW([dict(params=decay, lr=1e-3, weight_decay=0.1),
                                      dict(params=rest, lr=2e-3, weight_decay=0.0)])
        booster, model, opt = boost({PP2}, optimizer=two_groups)
        train(booster, model, opt, batch())
        booster.save_optimizer(opt, os.path.join(DIR, "optim"))
        booster2, model2, opt2 = boost({PP2}, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=7e-3))
        try:
            booster2.load_optimizer(opt2, os.path.join(DIR, "optim"))
        finally:
            note(f"after the load: lr={{opt2.optim.param_groups[0]['lr']}}, state entries={{len(opt2.optim.state)}}")
        ok("loaded")""",
      "an error on both ranks, nothing loaded", {-1: r"^CheckpointError: .*groups with different hyperparameters"}),
    S("8", "ZeRO-1 (dp=2) with a subclass of AdamW overriding `step`", 2, """
        class CentralizedAdamW(torch.optim.AdamW):
            @torch.no_grad()
            def step(self, closure=None):
                for g in self.param_groups:
                    for p in g["params"]:
                        if p.grad is not None and p.dim() > 1:
                            p.grad.sub_(p.grad.mean(dim=1, keepdim=True))
                return super().step(closure)
        booster, model, opt = boost(zero_stage=1, optimizer=lambda m: CentralizedAdamW(m.parameters()))
        ok("boosted")""",
      "TypeError at boost on both ranks", {-1: r"^TypeError: .*overrides step"}),
    S("9", "tp=2 ranks given different token ids of the same shape (execute_pipeline, 2 microbatches)", 2, """
        booster, model, opt = boost(tp_size=2, num_microbatches=2)
        step(booster, model, opt, batch(seed=RANK))
        ok("trained")""",
      "ValueError on both ranks naming prepare_dataloader", {-1: r"^ValueError: .*prepare_dataloader"}),
    S("10", "pp=2, `attention_mask` two tokens shorter than `input_ids`", 2, f"""
        booster, model, opt = boost({PP2})
        b = batch()
        b["attention_mask"] = b["attention_mask"][:, :-2]
        step(booster, model, opt, b)
        ok("trained")""",
      "ValueError on both ranks naming both shapes",
      {-1: r"^ValueError: (?=.*\(4, 6\))(?=.*\(4, 8\))"}),
    S("11", "pp_style='interleaved', num_model_chunks=2, precision='bf16', Llama, pp=2", 2, """
        booster, model, opt = boost("llama_lm", pp_size=2, pp_style="interleaved", num_model_chunks=2,
                                    num_microbatches=2, precision="bf16")
        losses = [train(booster, model, opt, batch("llama_lm", 4, n)) for n in range(2)]
        ok("trains, losses " + ", ".join(f"{l:.4f}" for l in losses))""",
      "trains (ok, loss printed)", {-1: r"^ok trains, losses \d"}),
    S("12", "README loop: 14 samples, batch 8, pp=2 num_microbatches=4, prepare_dataloader, one epoch", 2, """
        data = batch(size=14, seed=3)
        dataset = [{k: v[i] for k, v in data.items()} for i in range(14)]
        plugin = HybridParallelPlugin(pp_size=2, num_microbatches=4)
        booster = Booster(plugin=plugin)
        dataloader = plugin.prepare_dataloader(dataset, batch_size=8, shuffle=True)
        model = mu.build("gpt2_lm")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        model, optimizer, criterion, dataloader, sched = booster.boost(model, optimizer, mu.criterion, dataloader, sched)
        losses, sizes = [], []
        for b in dataloader:
            sizes.append(len(b["input_ids"]))
            out = booster.execute_pipeline(iter([b]), model, criterion, optimizer, return_loss=True)
            optimizer.step()
            optimizer.zero_grad()
            sched.step()
            losses.append(float(out["loss"]))
        ok(f"epoch done: {len(losses)} step(s) of {sizes} samples (of 14), losses {[round(l, 4) for l in losses]}")""",
      "the whole epoch trains", {-1: r"^ok epoch done: 1 step"}),
    S("13", "tp=2, pp=1, direct `model(**batch)` with sequence length 6 on rank 0, 8 on rank 1", 2, """
        booster, model, opt = boost(tp_size=2)
        model.train()
        b = {k: v[:, :6 if RANK == 0 else 8] for k, v in batch().items()}
        booster.backward(mu.criterion(model(**b), b), opt)
        ok("trained")""",
      "ValueError on both ranks (no crash)", {-1: r"^ValueError: "}),
    S("14", "`if rank == 0: booster.save_model(...)`, default timeout (pp=2); rank 1 goes on to execute_pipeline",
      2, f"""
        booster, model, opt = boost({PP2})
        train(booster, model, opt, batch())
        fault()
        if RANK == 0:
            booster.save_model(model, os.path.join(DIR, "model"))
        else:
            train(booster, model, opt, batch(seed=1))
        ok("returned")""",
      "rank 0 RuntimeError 'is collective' within ~60 s; rank 1 RankFailure naming rank 0",
      {0: r"^RuntimeError: .*is collective", 1: r"^RankFailure: .*rank 0"}, within=75),
    S("14b", "as 14, but rank 1 is busy elsewhere for 65 s (arrives after rank 0 failed and exited)", 2, f"""
        booster, model, opt = boost({PP2})
        train(booster, model, opt, batch())
        fault()
        if RANK == 0:
            booster.save_model(model, os.path.join(DIR, "model"))
        else:
            time.sleep(65)
            train(booster, model, opt, batch(seed=1))
        ok("returned")""",
      "rank 0 RuntimeError 'is collective' within ~60 s; rank 1 RankFailure naming rank 0 at its next step",
      {0: r"^RuntimeError: .*is collective", 1: r"^RankFailure: .*rank 0"}, within=90),
    S("15", "a frozen rank: rank 1 SIGSTOPs itself before a step (pp=2, timeout=20)", 2, f"""
        booster, model, opt = boost({PP2}, timeout=20)
        train(booster, model, opt, batch())
        fault()
        if RANK == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        train(booster, model, opt, batch(seed=1))
        ok("trained")""",
      "rank 0 fails within ~20 s; the runner then SIGKILLs the stopped rank 1",
      {0: r"^(RuntimeError|RankFailure|DistBackendError)", 1: r"killed by SIGKILL"}, within=35),
    S("16", "full disk during save_model (rank 1's writer raises ENOSPC), pp=2, shard=True", 2, f"""
        from booster_plugin.checkpoint import format as fmt
        booster, model, opt = boost({PP2})
        path = os.path.join(DIR, "model")
        saved = {{n: p.detach().clone() for n, p in model.unwrap().named_parameters()}}
        booster.save_model(model, path, shard=True, size_per_shard=0.02)
        train(booster, model, opt, batch())
        real = fmt.write_safetensors
        def full_disk(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        if RANK == 1:
            fmt.write_safetensors = full_disk
        fault()
        error = None
        try:
            booster.save_model(model, path, shard=True, size_per_shard=0.02)
        except Exception as e:
            error = e
        fmt.write_safetensors = real
        booster.load_model(model, path)
        same = all(torch.equal(p, saved[n]) for n, p in model.unwrap().named_parameters())
        partial = os.path.exists(os.path.join(DIR, ".model.partial"))
        note(f"previous checkpoint loads, parameters equal to the first save: {{same}}; partial dir left: {{partial}}")
        if error is not None:
            raise error
        ok("the second save succeeded")""",
      "CheckpointError on both ranks, previous checkpoint intact",
      {-1: r"^CheckpointError: .*No space left on device"}),
    S("17", "dp=2, direct calls; rank 1's forward raises (id out of vocab), the script catches it and goes on "
            "(timeout=20)", 2, """
        booster, model, opt = boost(timeout=20)
        model.train()
        def one_step(b):
            booster.backward(mu.criterion(model(**b), b), opt)
            opt.step()
            opt.zero_grad()
        one_step(batch(seed=RANK))
        fault()
        for n in range(1, 3):
            b = batch(seed=10 * n + RANK)
            if RANK == 1 and n == 1:
                b["input_ids"][0, 0] = 1000
            try:
                one_step(b)
                total = sum(float(p.double().sum()) for p in model.parameters())
                note(f"step {n} done (parameter sum {total:.6f})")
            except IndexError as e:
                note(f"step {n}: caught IndexError: {str(e).splitlines()[0]}")
        ok("went on")""",
      "RuntimeError 'replicas are out of step' on both ranks at the next backward (no step mixes replicas)",
      {-1: r"^RuntimeError: Data-parallel replicas are out of step"}, within=35),
    S("18", "`os._exit(0)` on rank 1 right after `save_model(..., use_async=True)` (pp=2, timeout=20); rank 0 "
            "synchronizes, then trains", 2, f"""
        booster, model, opt = boost({PP2}, timeout=20)
        train(booster, model, opt, batch())
        path = os.path.join(DIR, "model")
        booster.save_model(model, path, shard=True, size_per_shard=0.02, use_async=True)
        fault()
        if RANK == 1:
            os._exit(0)
        try:
            booster.checkpoint_io.synchronize()
            note("synchronize returned")
            train(booster, model, opt, batch(seed=1))
        finally:
            note(f"checkpoint directory exists: {{os.path.isdir(path)}}")
        ok("trained")""",
      "rank 0 CheckpointError naming the lost rank, within the 20 s timeout of the fault",
      {0: r"^CheckpointError: ", 1: r"^exit 0"}, within=35),
    S("19", "one dp replica runs one step more than the other (dp=2, pp=1, num_microbatches=2)", 2, """
        booster, model, opt = boost(num_microbatches=2, timeout=60)
        for n in range(2 + RANK):
            if n == 2:
                fault()
            train(booster, model, opt, batch(seed=10 * n + RANK))
        ok(f"{2 + RANK} steps")""",
      "rank 1 (the extra step) fails at once naming the cause: RankFailure 'rank 0 ... exited' (or, if the store still "
      "answers, RuntimeError 'another rank has left the job')",
      {0: r"^ok 2 steps", 1: r"^(RankFailure: .*rank 0 .*exited|RuntimeError: .*another rank has left the job)"}),
    S("20", "ranks build different models (GPT-2, 3 vs 4 layers), tp=2", 2, """
        booster, model, opt = boost(layers=3 + RANK, tp_size=2)
        ok("boosted")""",
      "ValueError 'The ranks built different models' on both ranks",
      {-1: r"^ValueError: The ranks built different models"}),
    S("21a", "`execute_pipeline(it, model, optimizer)` (criterion forgotten), pp=2", 2, f"""
        booster, model, opt = boost({PP2})
        booster.execute_pipeline(iter([batch()]), model, opt)
        ok("ran")""",
      "TypeError naming the order", {-1: r"^TypeError: .*criterion before the optimizer"}),
    S("21b", "`criterion=None` in a training step, pp=2", 2, f"""
        booster, model, opt = boost({PP2})
        booster.execute_pipeline(iter([batch()]), model, None, opt)
        ok("ran")""",
      "ValueError", {-1: r"^ValueError: .*criterion"}),
    S("22", "an empty batch (0 rows), pp=2", 2, f"""
        booster, model, opt = boost({PP2})
        step(booster, model, opt, {{k: v[:0] for k, v in batch().items()}})
        ok("ran")""",
      "ValueError 'The batch is empty'", {-1: r"^ValueError: The batch is empty"}),
    S("23", "execute_pipeline with a model that was not boosted, pp=2", 2, f"""
        booster, model, opt = boost({PP2})
        step(booster, mu.build("gpt2_lm"), opt, batch())
        ok("ran")""",
      "TypeError", {-1: r"^TypeError: .*booster\.boost"}),
    S("24", "boosting the same model object twice (tp=2)", 2, """
        model = mu.build("gpt2_lm")
        boost(model=model, tp_size=2)
        boost(model=model, tp_size=2)
        ok("boosted twice")""",
      "ValueError", {-1: r"^ValueError: .*boosted before"}),
    S("25", "a custom policy with a typo in its tp_plan (`q_prj`), OPT, tp=2", 2, """
        from shardformer.policies import Colwise
        from tests.test_custom_policy import OPTPolicy
        plan = {("decoder.layers.*.self_attn.q_prj" if k.endswith("q_proj") else k): v
                for k, v in OPTPolicy.tp_plan.items()}
        policy = type("OPTTypoPolicy", (OPTPolicy,), {"tp_plan": plan})()
        boost("opt_lm", tp_size=2, custom_policy=policy)
        ok("boosted")""",
      "ValueError naming the entry", {-1: r"^ValueError: .*q_prj"}),
    S("26", "float labels under tp=2 (execute_pipeline, 2 microbatches)", 2, """
        booster, model, opt = boost(tp_size=2, num_microbatches=2)
        b = batch()
        b["labels"] = b["labels"].float()
        step(booster, model, opt, b)
        ok("ran")""",
      "TypeError naming labels.long()", {-1: r"^TypeError: .*labels\.long\(\)"}),
    S("27", "a criterion returning a non-scalar (logits summed over the vocab), pp=2", 2, f"""
        booster, model, opt = boost({PP2})
        step(booster, model, opt, batch(), lambda out, b: out.logits.sum(-1))
        ok("ran")""",
      "TypeError on the last stage; the other stage ends too (RankFailure or exit 1)",
      {1: r"^TypeError: .*scalar", 0: r"^(RankFailure: |stopping: |exit 1).*rank 1"}),
    S("29", "a frozen rank with the default timeout (600 s): rank 1 SIGSTOPs itself before a step (pp=2, "
            "HYBRID_PARALLEL_FROZEN_RANK_S=20)", 2, f"""
        os.environ["HYBRID_PARALLEL_FROZEN_RANK_S"] = "20"
        booster, model, opt = boost({PP2})
        train(booster, model, opt, batch())
        fault()
        if RANK == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        train(booster, model, opt, batch(seed=1))
        ok("trained")""",
      "rank 0 stops within ~20-30 s naming rank 1 as frozen (no heartbeat); the runner SIGKILLs rank 1",
      {0: r"^stopping: rank 1 stopped responding", 1: r"killed by SIGKILL"}, within=60),
    S("30", "GeminiPlugin (max_norm): an AdamW built after boost, stepped after booster.backward", 2, """
        from booster_plugin import GeminiPlugin
        booster = Booster(plugin=GeminiPlugin(max_norm=1.0))
        model = mu.build("llama_lm")
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        rogue = torch.optim.AdamW(model.parameters(), lr=1e-3)
        b = batch("llama_lm")
        booster.backward(model(**b).loss, opt)
        rogue.step()
        ok("the rogue optimizer stepped")""",
      "RuntimeError 'did not go through booster.boost' on both ranks",
      {-1: r"^RuntimeError: .*did not go through booster\.boost"}),
    S("31", "TorchFSDPPlugin: `booster.backward(loss, optimizer)` with the optimizer that skipped boost", 2, """
        from booster_plugin import TorchFSDPPlugin
        booster = Booster(plugin=TorchFSDPPlugin())
        model = mu.build("llama_lm")
        model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        rogue = torch.optim.AdamW(model.parameters(), lr=1e-3)
        b = batch("llama_lm")
        booster.backward(model(**b).loss, rogue)
        ok("backward ran")""",
      "TypeError naming boost on both ranks", {-1: r"^TypeError: booster\.backward needs the optimizer"}),
    S("32", "a truncated model.safetensors under LazyInitContext + from_pretrained", 2, """
        from transformers import AutoModelForCausalLM
        from booster_plugin.colossalai.lazy import LazyInitContext
        path = os.path.join(DIR, "ckpt")
        if RANK == 0:
            torch.manual_seed(0)
            mu.build("llama_lm").save_pretrained(path)
            weights = os.path.join(path, "model.safetensors")
            with open(weights, "r+b") as f:
                f.truncate(100)
        time.sleep(3)
        with LazyInitContext():
            AutoModelForCausalLM.from_pretrained(path)
        ok("loaded")""",
      "ValueError naming the file and 'download it again' on both ranks",
      {-1: r"^ValueError: .*model\.safetensors is corrupted or truncated"}),
    S("33", "ring attention (sp_size=2, tp=1) with sequence length 6 under execute_pipeline", 2, """
        booster, model, opt = boost("llama_lm", sp_size=2, num_microbatches=2, enable_sequence_parallelism=True,
                                    sequence_parallelism_mode="ring_attn")
        step(booster, model, opt, {k: v[:, :6] for k, v in batch("llama_lm").items()})
        ok("ran")""",
      "ValueError naming sp_size=2 and the multiple 4 on both ranks",
      {-1: r"^ValueError: .*not a multiple of 4: .*sp_size=2 ranks in 2 chunks each"}),
    S("28", "`python -m hp_check NoSuchModelForCausalLM --tp 1 --pp 2` (a model class that does not exist)", 1, "",
      "exit status 4 'ERROR ... could not run' (or report what it does)", {0: r"^exit 4 .*ERROR .*could not run"},
      command=("-m", "hp_check", "NoSuchModelForCausalLM", "--tp", "1", "--pp", "2", "--timeout", "120")),
]
