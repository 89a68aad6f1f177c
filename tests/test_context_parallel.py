"""Sequence parallelism over a group of its own (`sp_size`): Ulysses ("all_to_all") and ring attention ("ring_attn")
composed with tp, pp, dp and ZeRO, exact against one process on plain and packed rows (documents marked by
position_ids restarting at 0); checkpoints saved under sp load into other layouts; ColossalAI's rules and errors."""
from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist
import transformers

from booster_plugin import Booster, HybridParallelPlugin
from tests import model_utils as mu
from tests.dist_utils import run_distributed

SP = dict(enable_sequence_parallelism=True)


def _four_ranks():
    # plain rows (right padding on one sample)
    mu.check_training("llama_lm", sp_size=2, tp_size=2, sequence_parallelism_mode="all_to_all", **SP)
    mu.check_training("llama_lm", sp_size=2, tp_size=2, sequence_parallelism_mode="ring_attn", **SP)
    # packed rows: every mode keeps attention inside each document, as one process does
    packed = "llama_packed_lm"
    mu.check_training(packed, tp_size=2, pp_size=2, num_microbatches=2)  # no sequence parallelism
    mu.check_training(packed, tp_size=2, sequence_parallelism_mode="split_gather", **SP)
    mu.check_training(packed, sp_size=2, sequence_parallelism_mode="all_to_all", zero_stage=1, **SP)  # dp 2
    mu.check_training(packed, sp_size=2, pp_size=2, num_microbatches=2, sequence_parallelism_mode="ring_attn", **SP)
    # the V schedule's input-gradient pass (I) leaves linear weights' gradients to W: the sp sums wait for them
    mu.check_training("llama_lm", steps=1, sp_size=2, pp_size=2, pp_style="zbv", num_model_chunks=2,
                      num_microbatches=4, sequence_parallelism_mode="all_to_all", **SP)
    mu.check_training(packed, sp_size=4, sequence_parallelism_mode="ring_attn", max_norm=0.1, **SP)
    mu.check_training(packed, sp_size=2, sequence_parallelism_mode="ring_attn", zero_stage=2, precision="bf16",
                      tol=3e-2, **SP)
    mu.check_training("llama_packed_cache_lm", sp_size=2, tp_size=2, sequence_parallelism_mode="ring_attn", **SP)
    mu.check_training("llama_packed_cache_lm", sp_size=2, sequence_parallelism_mode="all_to_all", **SP)


def test_sequence_parallel_group_four_ranks():
    run_distributed(4, _four_ranks)


def _checkpoints(directory: str):
    mu.check_training("llama_packed_lm", steps=2, sp_size=2, pp_size=2, num_microbatches=2,
                      sequence_parallelism_mode="ring_attn", save_to=directory, **SP)  # dp 1
    mu.check_training("llama_packed_lm", steps=3, tp_size=2, pp_size=2, num_microbatches=2,
                      resume_from=(directory, 2))  # dp 1, no sequence parallelism


def test_sequence_parallel_checkpoints(tmp_path):
    run_distributed(4, _checkpoints, str(tmp_path))


def _errors():
    with pytest.raises(ValueError, match="also set enable_sequence_parallelism=True"):
        HybridParallelPlugin(sp_size=2)
    with pytest.raises(ValueError, match="'ring_attn' passes key/value blocks .* set sp_size > 1"):
        HybridParallelPlugin(tp_size=2, sequence_parallelism_mode="ring_attn", **SP)
    with pytest.raises(ValueError, match=r"not divisible by tp_size \* pp_size \* sp_size = 2 \* 1 \* 4"):
        HybridParallelPlugin(tp_size=2, sp_size=4, sequence_parallelism_mode="ring_attn", **SP)
    with warnings.catch_warnings(record=True) as caught:  # (rank 0 warns)
        warnings.simplefilter("always")
        assert HybridParallelPlugin(tp_size=2, sequence_parallelism_mode="ring", **SP).sp_mode == "split_gather"
    assert (dist.get_rank() == 0) == any("runs as 'split_gather'" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sp_size with no mode: ColossalAI's default, all_to_all over its own group
        plugin = HybridParallelPlugin(sp_size=2, **SP)
    assert plugin.sp_mode == "all_to_all" and plugin.sp_group is plugin.ctx.sp.group and plugin.dp_size == 1
    one_kv_head = transformers.LlamaForCausalLM(mu.llama_config(num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"num_key_value_heads=1 for tp_size=1: tp_size \* sp_size must divide it"):
        Booster(plugin=plugin).boost(one_kv_head)
    ring = HybridParallelPlugin(sp_size=2, sequence_parallelism_mode="ring_attn", **SP)
    model, *_ = Booster(plugin=ring).boost(mu.build("llama_lm"))
    model.train()
    batch = {k: v[:, :6] for k, v in mu.make_batch("llama_lm", 2, 0).items()}  # 6 tokens: not a multiple of 4
    with pytest.raises(ValueError, match=r"sp_size=2 ranks in 2 chunks each \(ring_attn\), but this batch has "
                                         r"sequence length 6: pad the batch to a multiple of 4"):
        model(**batch)


def test_sequence_parallel_errors():
    run_distributed(2, _errors)


def _head_on_tokens():
    """all_to_all / ring_attn in training with labels: the LM head computes logits for this rank's tokens only (the
    loss is still one process's, with num_items_in_batch too); without labels or in eval mode it sees the whole
    sequence; pipeline outputs are the whole logits. Full exactness (gradients, AdamW) is check_training's above.
    (chunked_loss=False: the head computes these logits; the chunked loss on this rank's tokens is
    tests/test_chunked_loss.py's.)"""
    import copy

    import torch
    reference = mu.build("gpt2_lm")  # tied head: the input embedding's use of the weight is not summed over sp
    batch = mu.make_batch("gpt2_lm", 4, 0)
    items = torch.tensor(11)  # transformers' num_items_in_batch: the sum of token losses over it
    with torch.no_grad():
        expected = reference(**batch)
        expected_items = reference(**batch, num_items_in_batch=items).loss
    for mode in ("all_to_all", "ring_attn"):
        plugin = HybridParallelPlugin(sp_size=2, sequence_parallelism_mode=mode, num_microbatches=2,
                                      chunked_loss=False, **SP)
        booster = Booster(plugin=plugin)
        model, *_ = booster.boost(copy.deepcopy(reference))
        lengths = []
        model.unwrap().lm_head.register_forward_hook(lambda m, args, out: lengths.append(args[0].shape[1]))
        model.train()
        out = model(**batch)
        mu.assert_close(out.loss, expected.loss, f"{mode} loss")
        mu.assert_close(model(**batch, num_items_in_batch=items).loss, expected_items, f"{mode} loss over items")
        model(**{k: v for k, v in batch.items() if k != "labels"})
        step = booster.execute_pipeline(iter([batch]), model, mu.criterion, return_outputs=True)
        mu.assert_close(step["outputs"]["logits"], expected.logits, f"{mode} pipeline logits")
        model.eval()
        with torch.no_grad():
            mu.assert_close(model(**batch).logits, expected.logits, f"{mode} eval logits")
        half = mu.SEQ // 2
        assert lengths == [half, half, mu.SEQ, half, half, mu.SEQ], (mode, lengths)


def test_head_and_loss_on_this_ranks_tokens():
    run_distributed(2, _head_on_tokens)
