"""booster_plugin.colossalai mirrors ColossalAI's module paths: a ColossalAI script ported by the documented sed rule
imports, the warmup schedulers follow ColossalAI's formulas, and the distributed logger filters by rank."""
import inspect
import logging
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import booster_plugin.dist_logger as cai_logging
from booster_plugin.colossalai.nn.lr_scheduler import CosineAnnealingWarmupLR, LinearWarmupLR

SED_RULE = r"s/\bcolossalai\b/booster_plugin.colossalai/g"

COLOSSALAI_SCRIPT = """\
import colossalai
from colossalai.accelerator import get_accelerator
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin, Plugin
from colossalai.cluster import DistCoordinator
from colossalai.lazy import LazyInitContext
from colossalai.logging import disable_existing_loggers, get_dist_logger
from colossalai.nn.lr_scheduler import CosineAnnealingWarmupLR, LinearWarmupLR
from colossalai.nn.optimizer import HybridAdam
from colossalai.pipeline.schedule.v_schedule import PipelineGraph
from colossalai.shardformer import PipelineGradientCheckpointConfig
from colossalai.shardformer.policies.auto_policy import get_autopolicy
from colossalai.utils import get_current_device

launch = colossalai.launch_from_torch
"""


def _port(text: str) -> str:
    """The README's rule, through sed when there is one (GNU sed's \\b), else the same regular expression."""
    if shutil.which("sed"):
        return subprocess.run(["sed", "-E", SED_RULE], input=text, capture_output=True, text=True,
                              check=True).stdout
    return re.sub(r"\bcolossalai\b", "booster_plugin.colossalai", text)


def test_sed_rule_ports_the_imports():
    from booster_plugin import Booster, HybridParallelPlugin
    from booster_plugin.compat import DistCoordinator, HybridAdam, LazyInitContext, PipelineGraph, launch_from_torch
    ported = _port(COLOSSALAI_SCRIPT)
    assert "from booster_plugin.colossalai.booster import Booster" in ported
    names: dict = {}
    exec(compile(ported, "ported_script.py", "exec"), names)
    assert names["Booster"] is Booster and names["HybridParallelPlugin"] is HybridParallelPlugin
    assert names["DistCoordinator"] is DistCoordinator and names["HybridAdam"] is HybridAdam
    assert names["LazyInitContext"] is LazyInitContext and names["PipelineGraph"] is PipelineGraph
    assert names["launch"] is launch_from_torch
    assert issubclass(HybridParallelPlugin, names["Plugin"])
    assert names["get_current_device"]() == names["get_accelerator"]().get_current_device()
    assert names["PipelineGradientCheckpointConfig"]().gradient_checkpointing_ratio == 0.0  # ColossalAI's default


def test_example_is_the_sed_port_of_a_colossalai_script():
    """examples/colossalai_port.py's code (after its docstring, which quotes the rule) differs from its ColossalAI
    original by the substitution only."""
    text = (Path(__file__).resolve().parents[1] / "examples" / "colossalai_port.py").read_text()
    ported = text[text.index("\nimport "):]
    original = ported.replace("booster_plugin.colossalai", "colossalai")
    assert "from colossalai.booster import Booster" in original and "booster_plugin" not in original
    assert _port(original) == ported


def _lrs(scheduler_cls, steps: int, *args) -> list:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    scheduler = scheduler_cls(optimizer, *args)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_cosine_annealing_warmup_matches_colossalai():
    """ColossalAI (torch <= 2.5.1): warmup (t+1)/W, then torch's cosine over T-W steps starting at t = W."""
    total, warmup, eta_min, base = 10, 3, 0.1, 0.5
    lrs = _lrs(CosineAnnealingWarmupLR, 12, total, warmup, eta_min)
    assert lrs[:3] == pytest.approx([base / 3, 2 * base / 3, base])
    assert lrs[3] == pytest.approx(base)  # the peak is held for two steps, as in ColossalAI
    cosine = lambda k: eta_min + (base - eta_min) * (1 + math.cos(math.pi * k / (total - warmup))) / 2
    assert lrs[3:] == pytest.approx([cosine(t - warmup) for t in range(3, 12)])
    assert lrs[10] == pytest.approx(eta_min)
    assert _lrs(CosineAnnealingWarmupLR, 3, 4)[:3] == pytest.approx([base, base * (1 + math.cos(math.pi / 4)) / 2,
                                                                       base / 2])


def test_linear_warmup_matches_colossalai():
    total, warmup, base = 8, 2, 0.5
    lrs = _lrs(LinearWarmupLR, 10, total, warmup)
    expected = [base / 3, 2 * base / 3] + [base * (total - t) / (total - warmup) for t in range(2, 9)] + [0.0]
    assert lrs == pytest.approx(expected)  # past total_steps: 0, where ColossalAI's goes negative


def test_logger_filters_by_rank(monkeypatch):
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = cai_logging.get_dist_logger("test_colossalai_mirror")
    assert cai_logging.get_dist_logger("test_colossalai_mirror") is logger
    logging.getLogger("test_colossalai_mirror").addHandler(handler)
    try:
        for rank in (0, 1):
            monkeypatch.setattr(cai_logging, "_rank", lambda rank=rank: rank)
            logger.info(f"everyone {rank}")
            logger.info(f"first {rank}", ranks=[0])
            logger.warning(f"second {rank}", ranks=[1])
    finally:
        logging.getLogger("test_colossalai_mirror").removeHandler(handler)
    assert [r.getMessage() for r in records] == ["everyone 0", "first 0", "everyone 1", "second 1"]
    assert records[0].filename == "test_colossalai_mirror.py"  # the caller's line, as ColossalAI's prefix


def test_disable_existing_loggers(monkeypatch):
    """All existing loggers but `exclude` (default: ColossalAI's "colossalai"), or those in `include`, go to WARNING;
    the process's own loggers are swapped for three fresh ones so that other tests' levels stay untouched."""
    loggers = {name: logging.Logger(name, logging.INFO) for name in ("colossalai", "transformers", "other")}
    monkeypatch.setattr(logging.Logger.manager, "loggerDict", loggers)
    cai_logging.disable_existing_loggers()
    assert {n: lg.level for n, lg in loggers.items()} == dict(colossalai=logging.INFO, transformers=logging.WARNING,
                                                              other=logging.WARNING)
    loggers["colossalai"].setLevel(logging.INFO)
    loggers["other"].setLevel(logging.INFO)
    cai_logging.disable_existing_loggers(include=["colossalai"])
    assert loggers["colossalai"].level == logging.WARNING and loggers["other"].level == logging.INFO


# -- the test-support surface (colossalai.testing, .accelerator, .interface, .shardformer.layer, .tensor, ...) -------
def _spawned(rank: int, world_size: int, port: int, directory: str) -> None:
    """Run by `spawn` on every rank: ColossalAI's launch, then ColossalAI's own layer checks (test_linear_1d,
    test_vocab_parallel_embedding_1d) at tp=2 against the native modules; rank 1 then fails on purpose."""
    import torch.distributed as dist

    import booster_plugin.colossalai as colossalai
    from booster_plugin.colossalai.checkpoint_io.utils import gather_distributed_param
    from booster_plugin.colossalai.shardformer.layer import Linear1D_Col, Linear1D_Row, VocabParallelEmbedding1D
    from booster_plugin.colossalai.tensor.d_tensor import is_distributed_tensor
    from booster_plugin.colossalai.testing import assert_close

    colossalai.launch(rank=rank, world_size=world_size, host="localhost", port=port, verbose=False)
    torch.manual_seed(0)
    col_native, row_native, emb_native = torch.nn.Linear(8, 6), torch.nn.Linear(6, 4), torch.nn.Embedding(10, 4)
    col = Linear1D_Col.from_native_module(col_native, process_group=None, gather_output=True, overlap=True)
    row = Linear1D_Row.from_native_module(row_native, process_group=None, parallel_input=False)
    emb = VocabParallelEmbedding1D.from_native_module(emb_native, process_group=None)
    assert col.weight.shape == (3, 8) and row.weight.shape == (4, 3) and is_distributed_tensor(col.weight)
    assert torch.equal(gather_distributed_param(row.weight), row_native.weight.detach())
    assert torch.equal(gather_distributed_param(emb.weight), emb_native.weight.detach())  # without vocab padding
    ids = torch.randint(0, 10, (2, 5))
    x = emb_native(ids).detach().repeat(1, 1, 2).requires_grad_()
    x_shard = x.detach().clone().requires_grad_()
    assert_close(emb(ids), emb_native(ids))
    out, out_shard = row_native(col_native(x)), row(col(x_shard))
    assert_close(out_shard, out)
    out.sum().backward()
    out_shard.sum().backward()
    assert_close(x_shard.grad, x.grad)
    assert_close(col.weight.grad, col_native.weight.grad.chunk(world_size, 0)[rank])
    assert_close(row.weight.grad, row_native.weight.grad.chunk(world_size, 1)[rank])
    with open(os.path.join(directory, f"rank{rank}"), "w") as f:
        f.write(f"{world_size} {dist.get_backend()}")
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")


def test_spawn_runs_ranks_and_raises_their_failure(tmp_path):
    """ColossalAI's spawn: `func(rank, world_size=, port=, **kwargs)` on that many gloo processes (launch joins them),
    a rank's exception raised in the caller; the layer checks inside pass on both ranks before it."""
    from torch.multiprocessing import ProcessRaisedException

    from booster_plugin.colossalai.testing import spawn
    with pytest.raises(ProcessRaisedException, match="rank 1 fails on purpose"):
        spawn(_spawned, nprocs=2, directory=str(tmp_path))
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["2 gloo", "2 gloo"]


def test_testing_decorators_and_assertions():
    from booster_plugin.colossalai.testing import (assert_close_loose, assert_hf_output_close, check_state_dict_equal,
                                                   clear_cache_before_run, free_port, parameterize,
                                                   rerun_if_address_is_in_use, rerun_on_exception)
    calls = []

    @clear_cache_before_run()
    @parameterize("a", [1, 2])
    @parameterize("b", ["x", "y"])
    def combos(a, b, c):
        calls.append((a, b, c))

    combos(c=0)
    assert calls == [(1, "x", 0), (1, "y", 0), (2, "x", 0), (2, "y", 0)]
    assert list(inspect.signature(combos).parameters) == ["args", "kwargs"]  # pytest sees no fixtures to fill
    tries = []

    @rerun_on_exception(RuntimeError, pattern="^flaky", max_try=3)
    def flaky():
        tries.append(1)
        if len(tries) < 3:
            raise RuntimeError("flaky\nsecond line")
        return "done"

    assert flaky() == "done" and len(tries) == 3
    with pytest.raises(RuntimeError, match="other"):
        rerun_on_exception(RuntimeError, pattern="^flaky")(lambda: (_ for _ in ()).throw(RuntimeError("other")))()
    assert rerun_if_address_is_in_use()(lambda: 7)() == 7 and 20000 <= free_port() <= 65000
    state = {"w": torch.ones(2), "groups": [{"betas": (0.9, 0.99), "lr": 1.0}]}
    check_state_dict_equal(state, {"w": torch.ones(2) + 1e-4, "groups": [{"betas": (0.9, 0.99), "lr": 1.0}]})
    for other in ({"w": torch.ones(2) + 1e-2, "groups": state["groups"]},  # beyond 1e-3
                  {"w": torch.ones(2), "groups": [{"betas": [0.9, 0.99], "lr": 1.0}]}):  # a list is not a tuple
        with pytest.raises(AssertionError):
            check_state_dict_equal(state, other)
    with pytest.raises(AssertionError):
        assert_close_loose(torch.zeros(1), torch.full((1,), 0.01))
    assert_hf_output_close({"logits": torch.ones(2), "n": 1}, {"logits": torch.ones(2), "n": 1})
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_hf_output_close((torch.ones(2),), (torch.ones(3),))


def test_accelerator_api_on_cpu():
    """ColossalAI's accelerator API answers on the CPU as torch's CPU does (ColossalAI's CpuAccelerator raises)."""
    from booster_plugin.colossalai.accelerator import BaseAccelerator, CpuAccelerator, get_accelerator, set_accelerator
    acc = get_accelerator()
    assert isinstance(acc, CpuAccelerator) and isinstance(acc, BaseAccelerator)
    assert (acc.name, acc.communication_backend, acc.get_current_device(), acc.device_count()) == \
        ("cpu", "gloo", torch.device("cpu"), 1)
    state = acc.get_rng_state()
    first = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    acc.manual_seed(5)
    seeded = torch.rand(1)
    acc.manual_seed_all(5)
    assert torch.equal(torch.rand(1), seeded) and acc.initial_seed() == 5
    for figure in (acc.memory_allocated(), acc.max_memory_allocated(), acc.memory_reserved(),
                   acc.max_memory_reserved()):
        assert isinstance(figure, int) and figure > 0
    acc.reset_max_memory_allocated(), acc.reset_max_memory_cached(), acc.reset_peak_memory_stats()
    acc.empty_cache(), acc.synchronize()
    stream = acc.Stream()
    with acc.stream(stream), acc.autocast():
        acc.Event().record()
    set_accelerator("cpu")
    assert isinstance(get_accelerator(), CpuAccelerator) and get_accelerator() is not acc
    with pytest.raises(TypeError, match="set_accelerator"):
        set_accelerator(3)


def test_interface_tensor_and_refused_names():
    from booster_plugin import HybridParallelModule, HybridParallelOptimizer
    from booster_plugin.colossalai.fx import is_compatible_with_meta
    from booster_plugin.colossalai.interface import ModelWrapper, OptimizerWrapper
    from booster_plugin.colossalai.lazy.lazy_init import LazyInitContext
    from booster_plugin.colossalai.shardformer._utils import getattr_
    from booster_plugin.colossalai.shardformer.layer import Embedding1D, Linear1D_Col, VocabParallelEmbedding1D
    from booster_plugin.colossalai.shardformer.layer.utils import Randomizer
    from booster_plugin.colossalai.tensor.d_tensor.api import clear_layout_converter, is_distributed_tensor
    from booster_plugin.colossalai.tensor.padded_tensor.api import is_padded_tensor, to_unpadded_tensor
    from booster_plugin.colossalai.zero import LowLevelZeroOptimizer
    from booster_plugin.compat import LazyInitContext as Ours
    from booster_plugin.core.ddp_model import TorchDDPModel
    from booster_plugin.fsdp.model import FSDPModel
    from booster_plugin.core.zero import ZeroOptimizer
    assert issubclass(HybridParallelOptimizer, OptimizerWrapper) and issubclass(ZeroOptimizer, OptimizerWrapper)
    assert issubclass(HybridParallelModule, ModelWrapper) and issubclass(FSDPModel, ModelWrapper)
    assert issubclass(TorchDDPModel, ModelWrapper)
    assert LowLevelZeroOptimizer is ZeroOptimizer and LazyInitContext is Ours and is_compatible_with_meta()
    linear = torch.nn.Linear(3, 2)
    wrapped = ModelWrapper(ModelWrapper(linear))
    assert wrapped.unwrap() is linear and torch.equal(wrapped(torch.ones(3)), linear(torch.ones(3)))
    assert getattr_(torch.nn.Sequential(linear), "0.weight") is linear.weight
    assert getattr_(wrapped, "module.missing", ignore=True) is None
    col = Linear1D_Col.from_native_module(linear)  # one process: tp size 1, the whole layer
    assert torch.equal(col(torch.ones(3)), linear(torch.ones(3))) and is_distributed_tensor(col.weight)
    assert not is_distributed_tensor(linear.weight) and clear_layout_converter() is None
    emb = VocabParallelEmbedding1D.from_native_module(torch.nn.Embedding(5, 2))  # padded to 64 rows
    assert is_padded_tensor(emb.weight) and to_unpadded_tensor(emb.weight).shape == (5, 2)
    with pytest.raises(NotImplementedError, match="skip_bias_add"):
        Linear1D_Col(3, 2, skip_bias_add=True)
    with pytest.raises(NotImplementedError, match="vocabulary only"):
        Embedding1D(5, 2)
    Randomizer.increment_index()
    assert Randomizer.index() == 1
    Randomizer.reset_index()
    randomizer, before = Randomizer(7), torch.get_rng_state()
    with randomizer.fork_rng(enable_cpu=True):
        drawn = torch.rand(2)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(2)) and Randomizer.index() == 0
    torch.set_rng_state(before)
