"""Checkpoints: Hugging Face format from any (tp, pp) layout (plain from_pretrained loads it), loading into any
layout, exact resume of training (model + optimizer + scheduler), optimizer state re-sharded across layouts,
lazy (meta-device) init, clear errors that change nothing, and saves that survive a crash.

Also: per-tensor checksums (a flipped byte is refused), optimizer param groups matched by parameter name, state
for parameters the model lacks refused, background (use_async) saves, and single-file saves.

One world-4 gloo group runs every case (spawning costs seconds)."""
import argparse
import copy
import json
import os
import shutil
import struct
import threading

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, GPT2LMHeadModel

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.checkpoint import format as ckpt_format
from shardformer.layer.spec import get_tp_spec
from booster_plugin.checkpoint import jobs as ckpt_jobs
from booster_plugin.compat.checkpoint_io import CheckpointError
from tests import model_utils as mu
from tests.dist_utils import run_distributed

AUTO = {"gpt2_lm": AutoModelForCausalLM, "llama_lm": AutoModelForCausalLM, "bert_mlm": AutoModelForMaskedLM}
BATCH = 4


def _boost(kind, tp, pp, seed=0, meta=False, optimizer=False, precision="fp32", reference=None):
    """A boosted copy of `reference` (or of a fresh model built with `seed`, on the meta device if `meta`)."""
    plugin = HybridParallelPlugin(tp_size=tp, pp_size=pp, num_microbatches=max(2, pp), precision=precision)
    booster = Booster(plugin=plugin)
    if meta:
        with torch.device("meta"):
            model = mu.MODELS[kind](4)
    else:
        model = copy.deepcopy(reference) if reference is not None else mu.build(kind, seed=seed)
    opt = sched = None
    if optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=5)
    model, opt, *_ = booster.boost(model, opt)
    return plugin, booster, model, opt, sched


def _tp_group(plugin):
    return plugin.tp_group if plugin.tp_size > 1 else None


def _full(plugin, p):
    return mu.gathered(p, p.data, _tp_group(plugin))


def _assert_params_equal(plugin, model, reference, what, skip=()):
    """Every parameter this rank holds, gathered over tp, equals the reference's bit for bit."""
    ref = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in model.unwrap().named_parameters():
        if name in skip:
            continue
        full = _full(plugin, p)
        assert torch.equal(full.to(ref[name].dtype), ref[name].data), f"{what}: {name} differs from the reference"


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}


def _assert_unchanged(model, snapshot, what):
    for n, p in model.unwrap().named_parameters():
        assert torch.equal(p.data, snapshot[n]), f"{what}: {n} was changed by a failed load"


def _check_logits(plugin, booster, model, reference, kind, what):
    """Forward-only pipeline: the last stage's (gathered, unpadded) logits equal the reference's."""
    batch = mu.make_batch(kind, BATCH, seed=3)
    model.eval()
    reference.eval()
    with torch.no_grad():
        out = booster.execute_pipeline(iter([batch]), model, mu.criterion, return_loss=True, return_outputs=True)
        expected = reference(**batch).logits
    if plugin.is_last_stage():
        mu.assert_close(out["outputs"]["logits"], expected, f"{what} logits")
    model.train()


def _barrier():
    dist.barrier()


# -- 1. save from any layout, load with plain transformers --------------------------------------------------------
def _check_hf_loads(path, kind, reference, shard):
    files = sorted(os.listdir(path))
    assert "config.json" in files, files
    assert ("generation_config.json" in files) == reference.can_generate(), files
    if shard:
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            index = json.load(f)
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and all(s in files for s in shards), (shards, files)
        names = set(index["weight_map"])
        size = 0
        for s in shards:
            with safe_open(os.path.join(path, s), "pt") as f:
                size += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
        assert index["metadata"]["total_size"] == size
    else:
        assert "model.safetensors" in files and not any(f.endswith(".index.json") for f in files), files
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            names = set(f.keys())
    # HF's own convention: tied targets (GPT-2's lm_head, BERT's decoder) are not stored; everything else is
    expected = {n for n, _ in reference.named_parameters(remove_duplicate=False)} - set(reference.all_tied_weights_keys)
    assert names == expected, (names ^ expected)
    loaded = AUTO[kind].from_pretrained(path).eval()
    ref_state, state = reference.state_dict(), loaded.state_dict()
    assert set(state) == set(ref_state), set(state) ^ set(ref_state)
    for k, v in ref_state.items():
        assert torch.equal(state[k], v), f"{kind}: from_pretrained's {k} differs from the original model"
    batch = mu.make_batch(kind, BATCH, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, reference.eval()(**batch).logits, rtol=0, atol=0)


def _save_from_layouts(root):
    saved = {}
    cases = [(2, 2, "gpt2_lm", True), (2, 2, "llama_lm", False), (2, 2, "bert_mlm", True),
             (1, 4, "gpt2_lm", False), (1, 4, "llama_lm", True), (4, 1, "gpt2_lm", True), (4, 1, "llama_lm", False)]
    for tp, pp, kind, shard in cases:
        reference = mu.build(kind, seed=0)
        plugin, booster, model, *_ = _boost(kind, tp, pp, reference=reference)
        path = os.path.join(root, f"{kind}-tp{tp}-pp{pp}")
        booster.save_model(model, path, shard=shard, size_per_shard=0.02)  # ~20 kB files: several per stage
        if dist.get_rank() == 0:
            _check_hf_loads(path, kind, reference, shard)
        saved[(kind, tp, pp)] = path
        _barrier()
    return saved


# -- 2. load into another layout ----------------------------------------------------------------------------------
def _load_across_layouts(root, saved):
    cases = [(saved[("gpt2_lm", 2, 2)], "gpt2_lm", 1, 4), (saved[("gpt2_lm", 2, 2)], "gpt2_lm", 4, 1),
             (saved[("llama_lm", 1, 4)], "llama_lm", 2, 2), (saved[("gpt2_lm", 4, 1)], "gpt2_lm", 2, 2),
             (saved[("bert_mlm", 2, 2)], "bert_mlm", 4, 1)]
    # a checkpoint written by transformers itself
    hf_path = os.path.join(root, "hf-llama")
    if dist.get_rank() == 0:
        mu.build("llama_lm", seed=0).save_pretrained(hf_path)
    _barrier()
    cases.append((hf_path, "llama_lm", 4, 1))
    for path, kind, tp, pp in cases:
        reference = mu.build(kind, seed=0)
        plugin, booster, model, *_ = _boost(kind, tp, pp, seed=1)  # other weights until loaded
        booster.load_model(model, path)
        _assert_params_equal(plugin, model, reference, f"{os.path.basename(path)} -> tp{tp} pp{pp}")
        _check_logits(plugin, booster, model, reference, kind, f"{os.path.basename(path)} -> tp{tp} pp{pp}")


# -- 3. lazy init: build on meta, materialize this rank's shard, load -----------------------------------------------
def _lazy_init(saved):
    for kind, tp, pp, path in [("gpt2_lm", 2, 2, saved[("gpt2_lm", 1, 4)]),
                               ("llama_lm", 4, 1, saved[("llama_lm", 2, 2)])]:
        plugin, booster, model, *_ = _boost(kind, tp, pp, meta=True)
        # materialized and initialized: replicated tensors agree over tp, shards differ, vocab padding is zero
        for name, p in model.unwrap().named_parameters():
            assert p.device.type == "cpu" and torch.isfinite(p).all(), name
            parts = [torch.empty_like(p) for _ in range(tp)]
            dist.all_gather(parts, p.data.contiguous(), group=plugin.tp_group)
            spec = get_tp_spec(p)
            if spec is None:
                assert all(torch.equal(parts[0], q) for q in parts), f"lazy init: replicated {name} differs over tp"
            elif p.dim() == 2:
                assert not torch.equal(parts[0], parts[1]), f"lazy init: tp shards of {name} are identical"
            if spec is not None and spec.full_size is not None:
                full = torch.cat(parts, dim=spec.dim)
                assert not full.narrow(spec.dim, spec.full_size, full.size(spec.dim) - spec.full_size).any(), name
        for name, b in model.unwrap().named_buffers():
            assert not b.is_meta and torch.isfinite(b.float()).all(), name
        reference = mu.build(kind, seed=0)
        booster.load_model(model, path)
        _assert_params_equal(plugin, model, reference, f"lazy {kind} tp{tp} pp{pp}")
        _check_logits(plugin, booster, model, reference, kind, f"lazy {kind} tp{tp} pp{pp}")


# -- 4. clear errors, parameters unchanged --------------------------------------------------------------------------
def _bad_checkpoints(root, saved):
    good = saved[("gpt2_lm", 2, 2)]  # sharded
    single = saved[("gpt2_lm", 1, 4)]  # one model.safetensors
    bad = {k: os.path.join(root, f"bad-{k}") for k in ("truncated", "header", "missing_file", "shape", "arch",
                                                        "missing_tensor", "index")}
    if dist.get_rank() == 0:
        for k in ("truncated", "header", "missing_file", "index"):
            shutil.copytree(good, bad[k])
        with open(os.path.join(good, "model.safetensors.index.json")) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        victim = os.path.join(bad["truncated"], shards[1])
        os.truncate(victim, os.path.getsize(victim) - 100)
        with open(os.path.join(bad["header"], shards[2]), "r+b") as f:
            f.write(b"\xff" * 16)
        os.remove(os.path.join(bad["missing_file"], shards[-1]))
        with open(os.path.join(bad["index"], "model.safetensors.index.json"), "w") as f:
            f.write('{"weight_map": {"transformer.wte.weight": ')
        config = mu.gpt2_config()
        config.n_positions = 64
        torch.manual_seed(0)
        GPT2LMHeadModel(config).save_pretrained(bad["shape"])
        mu.build("llama_lm").save_pretrained(bad["arch"])
        shutil.copytree(single, bad["missing_tensor"])
        weights = load_file(os.path.join(single, "model.safetensors"))
        del weights["transformer.h.1.mlp.c_fc.bias"]
        save_file(weights, os.path.join(bad["missing_tensor"], "model.safetensors"), metadata={"format": "pt"})
    _barrier()
    with open(os.path.join(good, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    plugin, booster, model, *_ = _boost("gpt2_lm", 2, 2, seed=1)
    before = _snapshot(model)
    expectations = [
        ("truncated", rf"{shards[1]} is corrupted or truncated"),
        ("header", rf"{shards[2]} is corrupted or truncated"),
        ("missing_file", rf"{shards[-1]} does not exist"),
        ("index", r"model.safetensors.index.json is corrupted"),
        ("shape", r"'transformer.wpe.weight' has shape \[64, 32\], but the model's 'transformer.wpe.weight' has "
                  r"shape \[32, 32\]"),
        ("arch", r"checkpoint is a 'llama' model .* boosted model is 'gpt2'"),
        ("missing_tensor", r"no tensor for 1 parameter\(s\) .*transformer.h.1.mlp.c_fc.bias"),
    ]
    for key, pattern in expectations:
        with pytest.raises(CheckpointError, match=pattern):
            booster.load_model(model, bad[key])
        _assert_unchanged(model, before, key)
    with pytest.raises(CheckpointError, match="does not exist"):
        booster.load_model(model, os.path.join(root, "nowhere"))
    _assert_unchanged(model, before, "nowhere")
    # strict=False loads everything else and leaves the missing tensor as it was
    booster.load_model(model, bad["missing_tensor"], strict=False)
    reference = mu.build("gpt2_lm", seed=0)
    _assert_params_equal(plugin, model, reference, "strict=False", skip={"transformer.h.1.mlp.c_fc.bias"})
    for name, p in model.unwrap().named_parameters():
        if name == "transformer.h.1.mlp.c_fc.bias":
            assert torch.equal(p.data, before[name])
    return plugin, booster, model


# -- 5. a crashed save leaves the previous checkpoint loadable -------------------------------------------------------
class _Crash(BaseException):
    """Stands for the process dying: nothing catches it."""


def _crash_mid_save(root, saved):
    real_writer = ckpt_format.write_safetensors
    path = os.path.join(root, "crash")
    parent, name = os.path.split(path)
    partial = os.path.join(parent, f".{name}.partial")
    reference = mu.build("gpt2_lm", seed=0)
    other = mu.build("gpt2_lm", seed=1)

    # (a) a writer error (disk full, ...) on the ranks that write: every rank raises, the old checkpoint stays
    plugin, booster, model, *_ = _boost("gpt2_lm", 2, 2, reference=reference)
    booster.save_model(model, path, shard=True, size_per_shard=0.02)
    plugin2, booster2, model2, *_ = _boost("gpt2_lm", 2, 2, reference=other)
    calls = []

    def failing_writer(*args, **kwargs):
        calls.append(args[0])
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real_writer(*args, **kwargs)

    ckpt_format.write_safetensors = failing_writer
    try:
        with pytest.raises(CheckpointError, match="No space left on device"):
            booster2.save_model(model2, path, shard=True, size_per_shard=0.02)
    finally:
        ckpt_format.write_safetensors = real_writer
    _barrier()
    assert not os.path.exists(partial), "a failed save must remove its partial directory"
    booster2.load_model(model2, path)
    _assert_params_equal(plugin2, model2, reference, "after a failed save")

    # (b) every rank dies after writing its first file: the partial directory is never taken for a checkpoint
    plugin3, booster3, model3, *_ = _boost("gpt2_lm", 1, 4, reference=other)

    def crashing_writer(*args, **kwargs):
        real_writer(*args, **kwargs)
        raise _Crash()

    ckpt_format.write_safetensors = crashing_writer
    try:
        with pytest.raises(_Crash):
            booster3.save_model(model3, path, shard=True, size_per_shard=0.02)
    finally:
        ckpt_format.write_safetensors = real_writer
    _barrier()
    assert os.path.isdir(partial) and os.listdir(partial), "the simulated crash should leave a partial directory"
    assert not any(f.endswith(".index.json") for f in os.listdir(partial))
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        booster3.load_model(model3, partial)
    booster3.load_model(model3, path)
    _assert_params_equal(plugin3, model3, reference, "after a crashed save")
    if dist.get_rank() == 0:
        loaded = AutoModelForCausalLM.from_pretrained(path)
        assert torch.equal(loaded.transformer.wte.weight, reference.transformer.wte.weight)
    _barrier()
    # an interrupted swap (old checkpoint renamed away, new one not yet in place): loading falls back to it
    if dist.get_rank() == 0:
        os.rename(path, os.path.join(parent, f".{name}.old"))
    _barrier()
    with pytest.warns(UserWarning, match="interrupted"):
        booster3.load_model(model3, path)
    _assert_params_equal(plugin3, model3, reference, "from the backup of an interrupted swap")
    # the next save recovers, cleans up and succeeds
    model_other = _boost("gpt2_lm", 1, 4, reference=other)
    model_other[1].save_model(model_other[2], path, shard=True, size_per_shard=0.02)
    assert not os.path.exists(partial) and not os.path.exists(os.path.join(parent, f".{name}.old"))
    booster3.load_model(model3, path)
    _assert_params_equal(plugin3, model3, other, "after the next save")


# -- 6. resume: train, save, train; vs restart from the checkpoint ---------------------------------------------------
def _train_steps(plugin, booster, model, opt, sched, kind, steps, first):
    losses = []
    for step in range(first, first + steps):
        batch = mu.make_batch(kind, BATCH * plugin.dp_size, seed=100 + step)
        local = {k: v[plugin.dp_rank * BATCH:(plugin.dp_rank + 1) * BATCH] for k, v in batch.items()}
        opt.zero_grad()
        out = booster.execute_pipeline(iter([local]), model, mu.criterion, opt, return_loss=True)
        opt.step()
        sched.step()
        losses.append(out["loss"].detach().clone())
    return losses


def _resume(root):
    for kind, tp, pp, precision in [("gpt2_lm", 2, 2, "fp32"), ("llama_lm", 2, 1, "fp32"),
                                    ("llama_lm", 2, 2, "bf16")]:
        what = f"resume {kind} tp{tp} pp{pp} {precision}"
        path = os.path.join(root, f"resume-{kind}-{tp}-{pp}-{precision}")
        plugin, booster, model, opt, sched = _boost(kind, tp, pp, seed=0, optimizer=True, precision=precision)
        _train_steps(plugin, booster, model, opt, sched, kind, 2, first=0)
        booster.save_model(model, path + "/model", shard=True, size_per_shard=0.05)
        booster.save_optimizer(opt, path + "/optimizer")
        booster.save_lr_scheduler(sched, path + "/scheduler.json")
        lrs = [g["lr"] for g in opt.optim.param_groups]
        continued = _train_steps(plugin, booster, model, opt, sched, kind, 2, first=2)

        plugin2, booster2, model2, opt2, sched2 = _boost(kind, tp, pp, seed=1, optimizer=True, precision=precision)
        booster2.load_model(model2, path + "/model")
        booster2.load_optimizer(opt2, path + "/optimizer")
        booster2.load_lr_scheduler(sched2, path + "/scheduler.json")
        assert [g["lr"] for g in opt2.optim.param_groups] == sched2.get_last_lr() == lrs, what
        restarted = _train_steps(plugin2, booster2, model2, opt2, sched2, kind, 2, first=2)
        for i, (a, b) in enumerate(zip(continued, restarted)):
            assert torch.equal(a, b), f"{what}: step {2 + i} loss {a.item()!r} after restart, {b.item()!r} continued"
        for (n, p), (_, q) in zip(model.unwrap().named_parameters(), model2.unwrap().named_parameters()):
            assert torch.equal(p, q), f"{what}: {n} differs after the restarted steps"
        assert sched.state_dict() == sched2.state_dict(), what


# -- 7. optimizer state into another layout ------------------------------------------------------------------------
def _optimizer_across_layouts(root):
    kind = "gpt2_lm"
    path = os.path.join(root, "opt-cross")
    reference = mu.build(kind, seed=0)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    ref_sched = torch.optim.lr_scheduler.LinearLR(ref_opt, start_factor=0.5, total_iters=5)
    plugin, booster, model, opt, sched = _boost(kind, 2, 2, optimizer=True, reference=reference)
    for step in range(2):  # the unsharded reference takes the same steps on the whole batch
        _train_steps(plugin, booster, model, opt, sched, kind, 1, first=step)
        ref_opt.zero_grad()
        mu.microbatch_mean_loss(reference, mu.make_batch(kind, BATCH, seed=100 + step), BATCH // 2).backward()
        ref_opt.step()
        ref_sched.step()
    booster.save_model(model, path + "/model")
    booster.save_optimizer(opt, path + "/optimizer")
    booster.save_lr_scheduler(sched, path + "/scheduler.json")
    for tp, pp in [(4, 1), (1, 4)]:
        ref, r_opt = copy.deepcopy((reference, ref_opt))
        plugin2, booster2, model2, opt2, sched2 = _boost(kind, tp, pp, seed=1, optimizer=True)
        booster2.load_model(model2, path + "/model")
        booster2.load_optimizer(opt2, path + "/optimizer")
        booster2.load_lr_scheduler(sched2, path + "/scheduler.json")
        ref_params = dict(ref.named_parameters(remove_duplicate=False))
        names = {id(p): n for n, p in model2.unwrap().named_parameters()}
        for group in opt2.optim.param_groups:
            assert group["lr"] == r_opt.param_groups[0]["lr"]
            for p in group["params"]:
                state, ref_state = opt2.optim.state[p], r_opt.state[ref_params[names[id(p)]]]
                assert torch.equal(state["step"], ref_state["step"])
                for key in ("exp_avg", "exp_avg_sq"):
                    mu.assert_close(mu.gathered(p, state[key], _tp_group(plugin2)), ref_state[key],
                                    f"tp{tp} pp{pp} {names[id(p)]} {key}", tol=1e-6)
        # one more step on both: equal only if the moments were placed right on every shard
        _train_steps(plugin2, booster2, model2, opt2, sched2, kind, 1, first=2)
        r_opt.zero_grad()
        mu.microbatch_mean_loss(ref, mu.make_batch(kind, BATCH, seed=102), BATCH // max(2, pp)).backward()
        r_opt.step()
        for name, p in model2.unwrap().named_parameters():
            mu.assert_close(_full(plugin2, p), ref_params[name].data, f"tp{tp} pp{pp} step 3 {name}")


def _lr_scheduler_json(root):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    booster = Booster(plugin=HybridParallelPlugin())
    sched.milestones = {2, 4}  # a set is not JSON: refused, never pickled
    with pytest.raises(CheckpointError, match="cannot be stored as JSON"):
        booster.save_lr_scheduler(sched, os.path.join(root, "sched-bad.json"))
    assert not os.path.exists(os.path.join(root, "sched-bad.json"))


# -- 8. checksums: a flipped byte inside a tensor is refused, naming file and tensor -------------------------------
def _flip_byte(path, key):
    """Flip one bit in the middle of tensor `key`'s data (the header stays valid)."""
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        start, end = json.loads(f.read(length))[key]["data_offsets"]
        pos = 8 + length + (start + end) // 2
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x10]))


def _checksums(root, saved):
    good = saved[("gpt2_lm", 2, 2)]  # sharded, with an index
    bad = os.path.join(root, "bad-flipped")
    key = "transformer.h.3.mlp.c_proj.weight"  # held by stage 1 only: stage 0 learns it through the agreement
    with open(os.path.join(good, "model.safetensors.index.json")) as f:
        index = json.load(f)
    victim = index["weight_map"][key]
    assert set(index["checksums"]["tensors"]) == set(index["weight_map"]), "the index records every tensor's crc32"
    with safe_open(os.path.join(good, victim), "pt") as f:
        assert key in json.loads(f.metadata()["crc32"]), "the file's metadata records its tensors' crc32s"
    if dist.get_rank() == 0:
        shutil.copytree(good, bad)
        _flip_byte(os.path.join(bad, victim), key)
    _barrier()
    plugin, booster, model, *_ = _boost("gpt2_lm", 2, 2, seed=1)
    before = _snapshot(model)
    with pytest.raises(CheckpointError, match=rf"{victim}: tensor '{key}' fails its checksum"):
        booster.load_model(model, bad)
    _assert_unchanged(model, before, "flipped byte")
    # the fast path skips verification: the flipped value is loaded as is
    booster.load_model(model, bad, verify_checksums=False)
    reference = mu.build("gpt2_lm", seed=0)
    _assert_params_equal(plugin, model, reference, "verify_checksums=False", skip={key})
    # several verification threads find it too
    with pytest.raises(CheckpointError, match="fails its checksum"):
        booster.load_model(model, bad, num_threads=2)


# -- 9. optimizer: param groups matched by name, state for unknown parameters refused --------------------------------
def _two_groups(model, swapped=False, lrs=(1e-3, 2e-3), decays=(0.1, 0.0)):
    """AdamW with group 'decay' (weights) and 'no_decay' (biases, norms); `swapped`: listed in the other order."""
    params = list(model.named_parameters())
    decay = [p for n, p in params if n.endswith("weight") and "ln_" not in n]
    no_decay = [p for n, p in params if not (n.endswith("weight") and "ln_" not in n)]
    groups = [{"params": decay, "lr": lrs[0], "weight_decay": decays[0]},
              {"params": no_decay, "lr": lrs[1], "weight_decay": decays[1]}]
    return torch.optim.AdamW(groups[::-1] if swapped else groups, eps=1e-6)


def _boost_with(kind, layers, make_optimizer, tp=2, pp=2):
    plugin = HybridParallelPlugin(tp_size=tp, pp_size=pp, num_microbatches=2)
    booster = Booster(plugin=plugin)
    model = mu.build(kind, layers=layers, seed=0)
    model, opt, *_ = booster.boost(model, make_optimizer(model))
    return plugin, booster, model, opt


def _optimizer_groups(root):
    path = os.path.join(root, "opt-groups")
    plugin, booster, model, opt = _boost_with("gpt2_lm", 4, _two_groups)
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optim, lambda step: 1.0)
    _train_steps(plugin, booster, model, opt, sched, "gpt2_lm", 1, first=0)
    booster.save_optimizer(opt, path, use_async=True)  # the load below waits for it
    is_decay = {n: n.endswith("weight") and "ln_" not in n for n, _ in model.unwrap().named_parameters()}

    # swapped membership: each group gets the hyperparameters of the group its parameters were saved in
    plugin2, booster2, model2, opt2 = _boost_with("gpt2_lm", 4, lambda m: _two_groups(m, swapped=True, lrs=(5e-3, 5e-3),
                                                                                     decays=(0.5, 0.5)))
    booster2.load_optimizer(opt2, path)
    names = {id(p): n for n, p in model2.unwrap().named_parameters()}
    for group in opt2.optim.param_groups:
        for p in group["params"]:
            expected = (1e-3, 0.1) if is_decay[names[id(p)]] else (2e-3, 0.0)
            assert (group["lr"], group["weight_decay"]) == expected, (names[id(p)], group["lr"], group["weight_decay"])
            assert torch.equal(opt2.optim.state[p]["step"], torch.tensor(1.0))
    # one group holding parameters saved in groups with different hyperparameters: refused, nothing changed
    plugin3, booster3, model3, opt3 = _boost_with("gpt2_lm", 4, lambda m: torch.optim.AdamW(m.parameters(), lr=7e-3))
    with pytest.raises(CheckpointError, match="groups with different hyperparameters"):
        booster3.load_optimizer(opt3, path)
    assert opt3.optim.param_groups[0]["lr"] == 7e-3 and not opt3.optim.state

    # a 4-layer model's state into a 2-layer model: refused; strict=False warns naming them and loads the rest
    plugin4, booster4, model4, opt4 = _boost_with("gpt2_lm", 2, _two_groups)
    with pytest.raises(CheckpointError, match=r"state for \d+ parameter\(s\) the model does not have: .*transformer\.h\.2"):
        booster4.load_optimizer(opt4, path)
    assert not opt4.optim.state
    with pytest.warns(UserWarning, match=r"the model does not have: .*transformer\.h\.[23]"):
        booster4.load_optimizer(opt4, path, strict=False)
    for group in opt4.optim.param_groups:
        for p in group["params"]:
            assert torch.equal(opt4.optim.state[p]["step"], torch.tensor(1.0))

    # a flipped byte in an optimizer file is refused too
    bad = os.path.join(root, "opt-groups-flipped")
    if dist.get_rank() == 0:
        shutil.copytree(path, bad)
        _flip_byte(os.path.join(bad, "optimizer-pp001-tp001.safetensors"), "transformer.h.3.mlp.c_fc.weight/exp_avg")
    _barrier()
    with pytest.raises(CheckpointError, match=r"optimizer-pp001-tp001.safetensors: tensor "
                                              r"'transformer.h.3.mlp.c_fc.weight/exp_avg' fails its checksum"):
        booster2.load_optimizer(opt2, bad)


# -- 10. use_async: the call returns before the files exist; a later call or synchronize() completes them -----------
def _async_saves(root):
    path = os.path.join(root, "async")
    reference = mu.build("gpt2_lm", seed=0)
    plugin, booster, model, *_ = _boost("gpt2_lm", 2, 2, reference=reference)
    real_writer = ckpt_format.write_safetensors
    release = threading.Event()

    def held_writer(*args, **kwargs):
        assert threading.current_thread() is not threading.main_thread(), "use_async must write in the background"
        release.wait(60)
        return real_writer(*args, **kwargs)

    ckpt_format.write_safetensors = held_writer
    try:
        booster.save_model(model, path, shard=True, size_per_shard=0.02, use_async=True)
        assert not os.path.exists(path), "save_model(use_async=True) must return before the checkpoint is complete"
        with torch.no_grad():  # training goes on: the checkpoint keeps the values at the call
            for p in model.unwrap().parameters():
                p.add_(1.0)
        _barrier()
        release.set()
        booster.checkpoint_io.synchronize()
    finally:
        ckpt_format.write_safetensors = real_writer
    assert os.path.isdir(path) and not os.path.exists(os.path.join(os.path.dirname(path), ".async.partial"))
    plugin2, booster2, model2, *_ = _boost("gpt2_lm", 4, 1, seed=1)
    booster2.load_model(model2, path)
    _assert_params_equal(plugin2, model2, reference, "async save")

    # a background write that fails: synchronize raises on every rank, the previous checkpoint stays loadable
    def failing_writer(*args, **kwargs):
        raise OSError(28, "No space left on device")

    ckpt_format.write_safetensors = failing_writer
    try:
        booster.save_model(model, path, shard=True, size_per_shard=0.02, use_async=True)
        with pytest.raises(CheckpointError, match="No space left on device"):
            booster.checkpoint_io.synchronize()
        # never synchronized: reported at exit (what atexit prints), not lost
        booster.save_model(model, path, shard=True, size_per_shard=0.02, use_async=True)
        lost = ckpt_jobs.report_unsynchronized()
        if dist.get_rank() == 0:
            assert lost and "No space left on device" in lost[0] and "never synchronized" in lost[0], lost
    finally:
        ckpt_format.write_safetensors = real_writer
    booster2.load_model(model2, path)
    _assert_params_equal(plugin2, model2, reference, "after a failed async save")


# -- 11. shard=False with a file path: one file there -----------------------------------------------------------------
def _single_file(root):
    reference = mu.build("llama_lm", seed=0)
    plugin, booster, model, *_ = _boost("llama_lm", 2, 2, reference=reference)
    expected = {n for n, _ in reference.named_parameters()}
    for name in ("single/model.safetensors", "single/model.pt"):
        path = os.path.join(root, name)
        booster.save_model(model, path, use_async=name.endswith(".pt"))
        booster.checkpoint_io.synchronize()
        assert os.path.isfile(path), path
        if dist.get_rank() == 0:
            state = (load_file(path) if path.endswith(".safetensors") else torch.load(path, weights_only=True))
            assert set(state) == expected, set(state) ^ expected
            for n, p in reference.named_parameters():
                assert torch.equal(state[n], p.data), f"{name}: {n}"
        plugin2, booster2, model2, *_ = _boost("llama_lm", 4, 1, seed=1)
        booster2.load_model(model2, path)
        _assert_params_equal(plugin2, model2, reference, f"single file {name}")
    assert sorted(os.listdir(os.path.join(root, "single"))) == ["model.pt", "model.safetensors"]
    # a .pt holding more than plain tensors is refused by torch.load(weights_only=True): no pickle code runs
    evil = os.path.join(root, "evil.pt")
    if dist.get_rank() == 0:
        torch.save({"model.embed_tokens.weight": torch.zeros(1), "extra": argparse.Namespace(a=1)}, evil)
    _barrier()
    with pytest.raises(CheckpointError, match=r"evil.pt is corrupted or not a state dict of tensors"):
        booster.load_model(model, evil)


def _four_ranks(root):
    saved = _save_from_layouts(root)
    _load_across_layouts(root, saved)
    _lazy_init(saved)
    _bad_checkpoints(root, saved)
    _crash_mid_save(root, saved)
    _resume(root)
    _optimizer_across_layouts(root)
    _lr_scheduler_json(root)
    _checksums(root, saved)
    _optimizer_groups(root)
    _async_saves(root)
    _single_file(root)


def test_checkpoints_four_ranks(tmp_path):
    run_distributed(4, _four_ranks, str(tmp_path))


# -- 12. shard=True with a file-like name: a directory of that name (as ColossalAI) -----------------------------------
def _sharded_to_file_name(root):
    """`save_model(model, "x/model.bin", shard=True)` writes an HF directory named model.bin; load_model reads a
    directory whatever its suffix, into another layout, and from_pretrained loads it. save_optimizer: a directory."""
    reference = mu.build("llama_lm", seed=0)
    plugin, booster, model, opt, _ = _boost("llama_lm", 1, 2, reference=reference, optimizer=True)
    path, optim_path = os.path.join(root, "x/model.bin"), os.path.join(root, "x/optim.bin")
    booster.save_model(model, path, shard=True, size_per_shard=1)
    booster.save_optimizer(opt, optim_path, shard=True)
    assert os.path.isdir(path) and os.path.isdir(optim_path)
    if dist.get_rank() == 0:
        _check_hf_loads(path, "llama_lm", reference, shard=True)
    _barrier()
    plugin2, booster2, model2, opt2, _ = _boost("llama_lm", 2, 1, seed=1, optimizer=True)
    booster2.load_model(model2, path)
    booster2.load_optimizer(opt2, optim_path)
    _assert_params_equal(plugin2, model2, reference, "sharded save to x/model.bin")


def test_sharded_save_to_file_name_two_ranks(tmp_path):
    run_distributed(2, _sharded_to_file_name, str(tmp_path))
