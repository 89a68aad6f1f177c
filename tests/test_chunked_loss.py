"""The causal-LM loss in chunks (shardformer/chunked_loss.py, layer/linear_cross_entropy.py) equals the full loss:
the function against F.cross_entropy on the full logits (loss, gradients of hidden states, weight and bias, with
ignored targets, vocabulary padding, soft-capping, a scale, any chunk size), and models trained through the plugin
against the unsharded model (loss, gradients, parameters after AdamW, fp32, 1e-5) in a world of one, under tp=2
(vocab-parallel, padded vocabulary), pp=2 and sp=2 (all_to_all and ring_attn); the logits are never returned
where the loss was chunked, and are where a caller asks for them."""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F
import transformers

from booster_plugin import Booster, HybridParallelPlugin
from hp_check.tiny import tiny_config
from shardformer.layer.linear_cross_entropy import LogitTransform, VocabShard, linear_cross_entropy_sum
from tests import model_utils as mu
from tests.dist_utils import run_distributed

# Gemma 2 with a soft-cap small enough to matter on tiny logits; Granite divides its logits by logits_scaling
mu.MODELS["chunk_gemma2_lm"] = lambda n=4: transformers.Gemma2ForCausalLM(
    tiny_config(transformers.Gemma2Config, num_hidden_layers=n, final_logit_softcapping=0.5))
mu.MODELS["chunk_granite_lm"] = lambda n=4: transformers.GraniteForCausalLM(
    tiny_config(transformers.GraniteConfig, num_hidden_layers=n, logits_scaling=4.0))

SEEN: List[bool] = []  # per boosted-model criterion call: were the logits absent (the loss chunked)?


def _recording(outputs: Any, batch: Dict[str, Any]) -> torch.Tensor:
    if not isinstance(outputs, transformers.modeling_outputs.CausalLMOutputWithPast) or outputs.logits is None:
        SEEN.append(outputs.logits is None)  # (the reference's outputs carry logits: not recorded)
    return outputs.loss


mu.CRITERIA["chunk_llama_lm"] = _recording
mu.MODELS["chunk_llama_lm"] = mu.MODELS["llama_lm"]


def _full(h, w, b, targets, transform: LogitTransform, padded_from: int):
    z, _ = transform.apply(F.linear(h, w, b))
    return F.cross_entropy(z[:, :padded_from].float(), targets, reduction="sum")


@pytest.mark.parametrize("chunk", [1, 3, None])
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(softcap=2.0), LogitTransform(scale=0.25)])
def test_equals_full_cross_entropy(chunk, transform):
    """Loss and every gradient equal F.cross_entropy's on the whole logits (padding columns excluded there)."""
    torch.manual_seed(0)
    n, h, vocab, padded = 37, 16, 50, 64
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(padded, h).index_fill_(0, torch.arange(vocab, padded), 0.0).requires_grad_()
    bias = torch.randn(padded).requires_grad_()
    targets = torch.randint(0, vocab, (n,)).index_fill_(0, torch.arange(0, n, 4), -100)
    count = int((targets != -100).sum())
    params = (hidden, weight, bias)
    (_full(*params, targets, transform, vocab) / count).backward()
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    got = linear_cross_entropy_sum(*params, targets, VocabShard(0, vocab), transform, chunk)
    (got / count).backward()
    mu.assert_close(got, _full(*params, targets, transform, vocab).detach(), "loss", 1e-6)
    for p, want, name in zip(params, expected, ("hidden", "weight", "bias")):
        mu.assert_close(p.grad[:vocab] if name != "hidden" else p.grad, want[:vocab] if name != "hidden" else want,
                        f"{name} gradient", 1e-6)
    assert not weight.grad[vocab:].any(), "padding rows got a gradient"


def test_every_target_ignored_and_one_backward():
    """Every target ignored: the mean is nan and the gradients 0, as torch's; a second backward is refused."""
    hidden, weight = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    targets = torch.full((4,), -100)
    loss = linear_cross_entropy_sum(hidden, weight, None, targets, VocabShard(0, 10)) / (targets != -100).sum()
    loss.backward(retain_graph=True)
    assert loss.isnan() and not hidden.grad.any() and not weight.grad.any()
    with pytest.raises(RuntimeError, match="backpropagating it twice"):
        loss.backward()


def _world_of_one():
    for kind in ("chunk_gemma2_lm", "chunk_granite_lm"):  # soft-capping; a scale (logits / logits_scaling)
        mu.check_training(kind, steps=1, loss_chunk_size=5)
    SEEN.clear()
    mu.check_training("chunk_llama_lm", loss_chunk_size=3)
    mu.check_training("chunk_llama_lm", steps=1, num_microbatches=2)  # through execute_pipeline
    assert SEEN and all(SEEN), SEEN
    _check_loss_arguments()
    _check_logits_where_asked()
    _check_refusals()


def _boosted(**kwargs):
    reference = mu.build("llama_lm")
    booster = Booster(plugin=HybridParallelPlugin(**kwargs))
    model, *_ = booster.boost(copy.deepcopy(reference))
    return reference, booster, model


def _check_loss_arguments():
    """num_items_in_batch (token-weighted sum) and shift_labels reach the chunked loss as ForCausalLMLoss takes
    them: loss and gradients equal the reference's."""
    reference, _, model = _boosted(loss_chunk_size=4)
    batch = mu.make_batch("llama_lm", 4, 3)
    shifted = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:].roll(1, dims=1)  # not the labels' own shift
    for extra in (dict(num_items_in_batch=torch.tensor(13)), dict(shift_labels=shifted)):
        got, want = model(**batch, **extra), reference(**batch, **extra)
        assert got.logits is None
        mu.assert_close(got.loss, want.loss, f"loss with {list(extra)}")
        got.loss.backward()
        want.loss.backward()
        for (name, p), q in zip(model.unwrap().named_parameters(), reference.parameters()):
            mu.assert_close(p.grad, q.grad, f"gradient of {name} with {list(extra)}")
            p.grad = q.grad = None


def _check_logits_where_asked():
    """Eval mode, calls without labels and execute_pipeline(return_outputs=True) get the full logits."""
    reference, booster, model = _boosted(num_microbatches=2)
    batch = mu.make_batch("llama_lm", 4, 1)
    expected = reference(**batch).logits
    mu.assert_close(model(**{k: v for k, v in batch.items() if k != "labels"}).logits, expected, "no labels")
    out = booster.execute_pipeline(iter([batch]), model, mu.criterion, return_outputs=True)
    mu.assert_close(out["outputs"]["logits"], expected, "return_outputs logits")
    assert booster.execute_pipeline(iter([batch]), model, _recording)["outputs"] is None and SEEN[-1]
    model.eval()
    mu.assert_close(model(**batch).logits, expected, "eval logits")
    _, _, off = _boosted(chunked_loss=False)
    assert off.train()(**batch).logits is not None


def _check_refusals():
    """What the chunked loss cannot follow is refused, naming the fix."""
    with pytest.raises(ValueError, match="loss_chunk_size=0"):
        HybridParallelPlugin(loss_chunk_size=0)
    with pytest.raises(ValueError, match="enable_all_optimization=True turns the chunked loss on"):
        HybridParallelPlugin(chunked_loss=False, enable_all_optimization=True)
    _, _, model = _boosted()
    batch = mu.make_batch("llama_lm", 2, 0)
    with pytest.raises(ValueError, match="without logits_to_keep"):
        model(**batch, logits_to_keep=1)
    model.unwrap().lm_head.register_forward_hook(lambda module, args, out: out + 1.0)  # a change we cannot follow
    with pytest.raises(NotImplementedError, match="pass chunked_loss=False"):
        model(**batch)


def test_world_of_one():
    run_distributed(1, _world_of_one)


def _two_ranks():
    SEEN.clear()
    mu.check_training("chunk_llama_lm", tp_size=2, loss_chunk_size=3)  # vocab 100 padded to 2 x 64
    mu.check_training("chunk_gemma2_lm", steps=1, tp_size=2)  # soft-capping per vocab shard, tied head
    mu.check_training("chunk_llama_lm", pp_size=2, num_microbatches=2, loss_chunk_size=5)
    sp = dict(enable_sequence_parallelism=True, sp_size=2)
    mu.check_training("chunk_llama_lm", sequence_parallelism_mode="all_to_all", loss_chunk_size=3, **sp)
    mu.check_training("chunk_llama_lm", steps=1, sequence_parallelism_mode="ring_attn", **sp)
    assert SEEN and all(SEEN), SEEN


def test_tp_pp_sp_two_ranks():
    run_distributed(2, _two_ranks)
