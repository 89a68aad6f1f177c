"""booster_plugin.colossalai mirrors ColossalAI's module paths: a ColossalAI script ported by the documented sed rule
imports, the warmup schedulers follow ColossalAI's formulas, and the distributed logger filters by rank."""
import logging
import math
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
