"""The router's load-balancing loss of transformers' MoE models (`output_router_logits=True`) under pipeline
parallelism equals one process's: the loss is computed on the last stage from the router logits of ALL layers
(earlier stages' logits travel with the hidden states, shardformer/expert/router_logits.py), and its gradient reaches the
routers of earlier stages.

Reference: one process running the same microbatches (gradient accumulation over the same split), each
microbatch's loss the model's own (`outputs.loss`, cross-entropy + router_aux_loss_coef * aux_loss), averaged over
microbatches and data-parallel replicas as the pipeline averages them. Loss, every gradient and the parameters after
one AdamW step must agree to 1e-5 (fp32).
"""
import copy
from typing import Callable, Dict

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from booster_plugin import Booster, HybridParallelPlugin
from tests import model_utils as mu
from tests.dist_utils import run_distributed

LOCAL = 8  # samples per data-parallel replica
MOE = dict(vocab_size=mu.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
           router_aux_loss_coef=1.0, output_router_logits=True, pad_token_id=0)


def qwen3_moe(**overrides) -> Qwen3MoeForCausalLM:
    config = dict(MOE, head_dim=8, moe_intermediate_size=32, num_experts=4, **overrides)
    config.pop("num_local_experts")
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**config))


def mixtral(**overrides) -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(head_dim=8, **MOE, **overrides))


def _reference(reference, global_batch: Dict[str, torch.Tensor], dp: int, mb: int) -> torch.Tensor:
    """One process: the mean over replicas of the mean of each replica's microbatch losses; backward run."""
    losses = [mu.microbatch_mean_loss(reference, {k: v[r * LOCAL:(r + 1) * LOCAL] for k, v in global_batch.items()},
                                      mb) for r in range(dp)]
    torch.stack(losses).mean().backward()
    return torch.stack(losses).detach()


def _check(build: Callable[[], torch.nn.Module], **plugin_kwargs) -> None:
    """One training step of the boosted model against one process: loss, every gradient, parameters after AdamW."""
    plugin = HybridParallelPlugin(**plugin_kwargs)
    booster = Booster(plugin=plugin)
    reference = build()
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6))
    dp, rank = plugin.dp_size, plugin.dp_rank
    global_batch = mu.make_batch("moe_lm", LOCAL * dp, seed=5)
    local = {k: v[rank * LOCAL:(rank + 1) * LOCAL] for k, v in global_batch.items()}
    ref_losses = _reference(reference, global_batch, dp, LOCAL // plugin_kwargs["num_microbatches"])
    loss = booster.execute_pipeline(iter([local]), model, mu.criterion, opt, return_loss=True)["loss"]
    what = f"{type(reference).__name__} {plugin_kwargs}"
    mu.assert_close(loss, ref_losses[rank], f"{what}: loss")
    tp = plugin.tp_group if plugin.tp_size > 1 else None
    held = dict(model.unwrap().named_parameters())
    for name, p in held.items():
        mu.assert_close(mu.gathered(p, p.grad, tp), reference.get_parameter(name).grad, f"{what}: grad of {name}")
    opt.step()
    ref_opt.step()
    for name, p in held.items():
        mu.assert_close(mu.gathered(p, p.data, tp), reference.get_parameter(name).data, f"{what}: {name} after step")


STYLES = [dict(pp_style="1f1b"), dict(pp_style="interleaved", num_model_chunks=2),
          dict(pp_style="zbv", num_model_chunks=2), dict(pp_style="dualpipev", num_model_chunks=2)]


def _check_evaluation_and_payload(output_router_logits: bool) -> None:
    """Forward-only: the merged outputs hold every layer's router logits, as one process's; the stages send router
    logits only when the model records them (output_router_logits=False: the hidden states alone)."""
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2)
    booster = Booster(plugin=plugin)
    reference = qwen3_moe(output_router_logits=output_router_logits).eval()
    model, *_ = booster.boost(copy.deepcopy(reference))
    model.eval()
    p2p, sent = plugin.schedule.p2p, []
    exchange = p2p.exchange
    p2p.exchange = lambda sends, recvs: sent.extend(sorted(s[2]) for s in sends) or exchange(sends, recvs)
    batch = mu.make_batch("moe_lm", LOCAL, seed=6)
    with torch.no_grad():
        out = booster.execute_pipeline(iter([batch]), model, mu.criterion, return_loss=True, return_outputs=True)
        mu.assert_close(out["loss"], mu.microbatch_mean_loss(reference, batch, LOCAL // 2), "eval loss")
        expected = reference(**batch).router_logits
    keys = ["hidden_states", "pipeline_router_logits"] if output_router_logits else ["hidden_states"]
    assert sent == ([keys] * 2 if plugin.is_first_stage() else []), sent
    if plugin.is_last_stage() and output_router_logits:
        assert len(out["outputs"].router_logits) == 4
        for layer, (got, want) in enumerate(zip(out["outputs"].router_logits, expected)):
            mu.assert_close(got, want, f"router logits of layer {layer}")


def _four_ranks() -> None:
    for style in STYLES:  # pp=2 x dp=2
        _check(qwen3_moe, pp_size=2, num_microbatches=4, **style)
    _check(qwen3_moe, pp_size=2, tp_size=2, num_microbatches=2)  # pp=2 x tp=2
    _check(mixtral, pp_size=2, num_microbatches=2)
    _check(lambda: qwen3_moe(output_router_logits=False), pp_size=2, num_microbatches=2)  # no aux loss: unaffected
    for output_router_logits in (True, False):
        _check_evaluation_and_payload(output_router_logits)


def test_router_loss_under_pipeline_parallelism():
    run_distributed(4, _four_ranks)
