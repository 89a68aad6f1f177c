"""Every Python block of the README runs, as written, on 4 ranks: the README cannot drift from the code.

A block is preceded by `<!-- readme-test: ranks=4 setup=NAME -->`; NAME picks the variables the block assumes
(a model, an optimizer, a dataset, ...), built fresh for each block. A Python block without that line fails the test.
"""
import os
import re
from pathlib import Path

import torch

from tests import model_utils as mu
from tests.dist_utils import run_distributed

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- readme-test: ranks=(\d+) setup=(\w+) -->\n)?```python\n(.*?)```", re.S)


def readme_blocks():
    """[(ranks, setup, code)] of every ```python block; ranks None where the marker is missing."""
    return [(int(m.group(2)) if m.group(1) else None, m.group(3), m.group(4))
            for m in BLOCK.finditer(README.read_text())]


def _gpt2_setup():
    torch.manual_seed(0)
    model = mu.build("gpt2_lm")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples = [{k: v[0] for k, v in mu.make_batch("gpt2_lm", 1, seed).items()} for seed in range(16)]
    return dict(model=model, optimizer=optimizer, criterion=lambda out, batch: out.loss, dataset=samples,
                lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                batch=mu.make_batch("gpt2_lm", 8, 0))


def _opt_setup():
    model = mu.build("opt_lm")
    return dict(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))


def _boosted_setup():
    from booster_plugin import Booster, HybridParallelPlugin

    names = _gpt2_setup()
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2))
    model, optimizer, criterion, _, lr_scheduler = booster.boost(names["model"], names["optimizer"],
                                                                 names["criterion"], None, names["lr_scheduler"])
    booster.execute_pipeline(iter([names["batch"]]), model, criterion, optimizer)
    optimizer.step()
    return dict(booster=booster, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)


def _llama_setup():
    model = mu.build("llama_lm")
    return dict(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                batches=[mu.make_batch("llama_lm", 8, seed) for seed in range(2)])


def _moe_setup():
    import tests.test_expert_parallel  # noqa: F401  (registers the "qwen3moe_lm" builder)
    model = mu.build("qwen3moe_lm")
    return dict(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), criterion=mu.criterion,
                batches=[mu.make_batch("qwen3moe_lm", 8, seed) for seed in range(2)])


def _t5_setup():
    import tests.test_encoder_decoder  # noqa: F401  (registers the "t5_lm" builder)

    model = mu.build("t5_lm", 3)
    return dict(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                batch=mu.make_batch("t5_lm", 8, 0))


def _trl_setup():
    from tests.test_trl import _tokenizer  # a word-level tokenizer over the tiny vocabulary ("w3" is id 3)

    return dict(model=mu.build("llama_packed_lm"), tokenizer=_tokenizer())


SETUPS = {"gpt2": _gpt2_setup, "opt": _opt_setup, "boosted": _boosted_setup, "llama": _llama_setup,
          "t5": _t5_setup, "moe": _moe_setup, "trl": _trl_setup, "none": dict}


def _run_blocks(blocks, workdir: str) -> None:
    os.chdir(workdir)  # the same directory on every rank: checkpoints are written collectively
    for i, (setup, code) in enumerate(blocks):
        namespace = SETUPS[setup]()
        try:
            exec(compile(code, f"README.md python block {i}", "exec"), namespace)
        except BaseException as failure:
            raise AssertionError(f"README python block {i} (setup={setup}) failed:\n{code}") from failure


def test_every_python_block_has_a_marker():
    blocks = readme_blocks()
    assert len(blocks) >= 5
    assert all(ranks is not None for ranks, _, _ in blocks), [code[:80] for r, _, code in blocks if r is None]
    assert all(setup in SETUPS for _, setup, _ in blocks)


def test_readme_python_blocks_run(tmp_path):
    by_ranks = {}
    for ranks, setup, code in readme_blocks():
        by_ranks.setdefault(ranks, []).append((setup, code))
    for ranks, blocks in sorted(by_ranks.items()):
        run_distributed(ranks, _run_blocks, blocks, str(tmp_path))
