"""Ranks that must see the same batch do, or every rank raises the same error: contents compared over tp and pp (a
sampler over the whole world, stages given different or shuffled batches), an attention mask that does not match its
ids, sequence lengths differing between tp ranks in a call the script makes itself; the README's loop over an epoch
whose last batch is short; optimizer param groups checked over every stage's parameters at load_optimizer.

One call of 2 ranks runs every case."""
import os

import pytest
import torch
import torch.distributed as dist

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.compat.checkpoint_io import CheckpointError
from tests import model_utils as mu
from tests.dist_utils import run_distributed

GOOD = mu.make_batch("gpt2_lm", 4, 0)
PP2, TP2 = dict(pp_size=2, num_microbatches=2), dict(tp_size=2, num_microbatches=2)


def _rank():
    return dist.get_rank()


def _step(plugin_kwargs, batch):
    booster = Booster(plugin=HybridParallelPlugin(**plugin_kwargs))
    model, *_ = booster.boost(mu.build("gpt2_lm"))
    return booster.execute_pipeline(iter([batch]), model, mu.criterion)


def _per_rank(make):
    """A batch that rank 1 alters with `make(batch)`."""
    return make({k: v.clone() for k, v in GOOD.items()}) if _rank() else GOOD


def _rows_swapped(batch):
    return {k: v[[1, 0, 2, 3]] for k, v in batch.items()}  # the same multiset of rows, shuffled


def _tokens_swapped(batch):
    batch["input_ids"][1, [2, 5]] = batch["input_ids"][1, [5, 2]]  # two tokens of one sample swapped
    return batch


def _direct(plugin_kwargs, batch):
    """pp=1: the script calls the model itself."""
    booster = Booster(plugin=HybridParallelPlugin(**plugin_kwargs))
    model, *_ = booster.boost(mu.build("gpt2_lm"))
    model.train()
    return mu.criterion(model(**batch), batch)


DIFFERENT = "The ranks of data-parallel replica 0 got different batches"
CONTENTS = DIFFERENT + ": rank 0 and rank 1 have the same shapes but different contents of \\['input_ids'"
ALL_THREE = "different contents of \\['attention_mask', 'input_ids', 'labels'\\]"
FIX = "plugin.prepare_dataloader.*DistributedSampler\\(num_replicas=dp_size, rank=dp_rank\\)"
SHORT_MASK = {**GOOD, "attention_mask": GOOD["attention_mask"][:, :6]}
CASES = [
    # tp ranks given different token ids of the same shape (a sampler over the world instead of dp)
    (lambda: _step(TP2, mu.make_batch("gpt2_lm", 4, _rank())), ValueError, CONTENTS + ".*" + FIX),
    # pipeline stages given different batches, or the same rows shuffled, or two tokens swapped
    (lambda: _step(PP2, mu.make_batch("gpt2_lm", 4, _rank())), ValueError, CONTENTS),
    (lambda: _step(PP2, _per_rank(_rows_swapped)), ValueError, ALL_THREE),
    (lambda: _step(PP2, _per_rank(_tokens_swapped)), ValueError, CONTENTS),
    (lambda: _step(PP2, _per_rank(lambda b: {**b, "labels": b["labels"].roll(1)})), ValueError,
     DIFFERENT + ".* different contents of \\['labels'\\]"),
    # an attention mask two tokens shorter than the ids, on every rank or on one
    (lambda: _step(PP2, SHORT_MASK), ValueError,
     "attention_mask on rank 0 \\(data-parallel replica 0\\) has shape \\(4, 6\\) but input_ids has \\(4, 8\\)"),
    (lambda: _step(PP2, SHORT_MASK if _rank() else GOOD), ValueError, "attention_mask on rank 1 .* \\(4, 6\\) but "
                                                                      "input_ids has \\(4, 8\\)"),
    # the script calls the model itself (pp=1) with sequence lengths or contents differing between tp ranks
    (lambda: _direct(dict(tp_size=2), {k: v[:, :6 + 2 * _rank()] for k, v in GOOD.items()}), ValueError,
     DIFFERENT + ": rank 0 has tensor shapes \\[\\(4, 6\\), \\(4, 6\\), \\(4, 6\\)\\] .* rank 1 has tensor shapes "
                 "\\[\\(4, 8\\)"),
    (lambda: _direct(dict(tp_size=2), mu.make_batch("gpt2_lm", 4, _rank())), ValueError, CONTENTS),
    # a last batch that does not split names drop_last
    (lambda: _step(dict(pp_size=2, num_microbatches=4), mu.make_batch("gpt2_lm", 6, 0)), ValueError,
     "Batch size 6 is not divisible into num_microbatches=4.*drop_last=True"),
]


def _check_cases():
    """Every rank raises, the same message (so nobody is stuck in a collective), and the group still works."""
    for make, exc, pattern in CASES:
        try:
            with pytest.raises(exc, match=pattern) as raised:
                make()
        except BaseException as failure:
            raise AssertionError(f"case expecting {exc.__name__}({pattern!r})") from failure
        messages = [None, None]
        dist.all_gather_object(messages, str(raised.value))
        assert messages[0] == messages[1], messages


def _check_agreeing_ranks_still_train():
    """Different batches on different replicas (dp=2) are fine, and so are equal batches over tp and pp; a direct
    call under tp=2 (same batch) gives the reference loss."""
    _step(dict(num_microbatches=2), mu.make_batch("gpt2_lm", 4, _rank()))  # dp=2: replicas differ, as they should
    for kwargs in (PP2, TP2):
        _step(kwargs, GOOD)
    loss = _direct(dict(tp_size=2), GOOD)
    mu.assert_close(loss, mu.build("gpt2_lm").train()(**GOOD).loss, "direct call under tp=2")


def _check_readme_loop_over_a_short_last_batch():
    """The README's loop, over a dataset whose size (14) is not a multiple of the batch (8), under pp=2: the
    default drop_last drops the short batch, so the epoch runs; without microbatches the last batch is kept."""
    samples = [{k: v[0] for k, v in mu.make_batch("gpt2_lm", 1, seed).items()} for seed in range(14)]
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=4)
    booster = Booster(plugin=plugin)
    model = mu.build("gpt2_lm")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    dataloader = plugin.prepare_dataloader(samples, batch_size=8, shuffle=True)
    model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(model, optimizer, mu.criterion, dataloader,
                                                                          lr_scheduler)
    steps = 0
    for batch in dataloader:
        out = booster.execute_pipeline(iter([batch]), model, criterion, optimizer, return_loss=True)
        optimizer.step()
        optimizer.zero_grad()
        lr_scheduler.step()
        assert torch.isfinite(out["loss"])
        steps += 1
    assert steps == 1
    assert len(HybridParallelPlugin(tp_size=2).prepare_dataloader(samples, batch_size=8)) == 2


def _layer_groups(model, layers, lrs):
    """Group 0: the decoder layers `layers`, with lr lrs[0]; group 1: every other parameter, with lr lrs[1]."""
    groups = ([], [])
    for name, p in model.named_parameters():
        groups[0 if any(name.startswith(f"transformer.h.{i}.") for i in layers) else 1].append(p)
    return torch.optim.AdamW([{"params": params, "lr": lr} for params, lr in zip(groups, lrs)])


def _boost_pp2(layers, lrs):
    booster = Booster(plugin=HybridParallelPlugin(pp_size=2, num_microbatches=2))
    model = mu.build("gpt2_lm")
    model, opt, *_ = booster.boost(model, _layer_groups(model, layers, lrs))
    return booster, model, opt


def _check_optimizer_groups_over_every_stage(root):
    """Saved with group 0 = layers 0-1 (lr 0.5, all on stage 0) and group 1 = the rest (lr 0.001); loaded into an
    optimizer whose group 0 holds every layer: each stage alone sees one saved group per current group, but the
    whole model's group 0 regroups two saved groups with different lr, so every rank refuses, changing nothing.
    The same grouping loads."""
    path = os.path.join(root, "optimizer")
    booster, model, opt = _boost_pp2((0, 1), (0.5, 1e-3))
    booster.execute_pipeline(iter([GOOD]), model, mu.criterion, opt)
    opt.step()
    booster.save_optimizer(opt, path)
    booster2, _, opt2 = _boost_pp2((0, 1, 2, 3), (7e-3, 7e-3))
    with pytest.raises(CheckpointError, match="param group 0 holds 'transformer.h.0.* \\(pipeline stage 0\\) and "
                                              "'transformer.h.2.* \\(pipeline stage 1\\), which the checkpoint has in "
                                              "groups with different hyperparameters"):
        booster2.load_optimizer(opt2, path)
    assert [g["lr"] for g in opt2.optim.param_groups] == [7e-3, 7e-3] and not opt2.optim.state
    booster3, _, opt3 = _boost_pp2((0, 1), (7e-3, 7e-3))
    booster3.load_optimizer(opt3, path)
    assert [g["lr"] for g in opt3.optim.param_groups] == ([0.5, 1e-3] if _rank() == 0 else [7e-3, 1e-3])
    assert all(opt3.optim.state[p]["step"] == 1 for g in opt3.optim.param_groups for p in g["params"])


def _two_ranks(root):
    _check_cases()
    _check_agreeing_ranks_still_train()
    _check_readme_loop_over_a_short_last_batch()
    _check_optimizer_groups_over_every_stage(root)


def test_batch_agreement_and_optimizer_groups_two_ranks(tmp_path):
    run_distributed(2, _two_ranks, str(tmp_path))
