"""LoRA through peft (`Booster.enable_lora`, `save_lora_as_pretrained`).

Adapters on tensor-parallel layers train like single-process peft (loss, LoRA gradients and parameters at 1e-5,
base weights unchanged) under tp=2 × pp=2 (Llama; GPT-2: Conv1D, fused q|k|v, frozen embedding tied across stages)
and tp=2 × dp=2 with ZeRO-1; the saved adapter loads into the unsharded model with plain peft and gives the same
logits; LoRA dropout masks agree over tp on replicated inputs only. A LoRA model saves with `save_model` under the base model's names and loads back; built on the meta device,
its adapters get peft's init and `load_model` of the base checkpoint leaves them alone. Bad uses are refused.

The distributed checks (`check_lora`) run in test_tensor_parallel's 4-rank group: a group of their own would cost
its start-up again.
"""
import copy
import os

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from transformers import LlamaForCausalLM

from booster_plugin import Booster, HybridParallelPlugin
from booster_plugin.core.lora import enable_lora
from shardformer.tensor.lora_sharding import LoRAShardingError
from tests import model_utils as mu

TARGETS = {"llama_lm": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "gpt2_lm": ["c_attn", "c_proj", "c_fc"],
           "qwen3moe_lm": ["q_proj", "k_proj", "v_proj", "o_proj"]}  # (tests/test_expert_parallel.py's MoE)


def _config(kind: str, **overrides) -> LoraConfig:
    # init_lora_weights=False: lora_B is random too, so every adapter gets a gradient from the first step
    kwargs = dict(r=4, lora_alpha=8, target_modules=TARGETS[kind], init_lora_weights=False,
                  fan_in_fan_out=kind.startswith("gpt2"))
    return LoraConfig(**{**kwargs, **overrides})


def _train_like_peft(kind: str, steps: int = 2, local_batch: int = 4, **plugin_kwargs):
    """Boost a LoRA model and train it next to single-process peft on the same global batches; compare loss, the
    stepped LoRA gradients and every parameter. Returns (booster, boosted model, base model, reference)."""
    plugin = HybridParallelPlugin(**plugin_kwargs)
    booster = Booster(plugin=plugin)
    base = mu.build(kind).to(mu.DEVICE)
    torch.manual_seed(1)
    reference = get_peft_model(copy.deepcopy(base), _config(kind))
    torch.manual_seed(1)
    model = booster.enable_lora(copy.deepcopy(base), lora_config=_config(kind))
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)  # frozen parameters included: never stepped
    model, opt, *_ = booster.boost(model, opt, mu.criterion)
    tp_group = plugin.tp_group if plugin.tp_size > 1 else None
    experts = model.info.expert_params  # split over ep: gathered over the ep group too
    ep_of = lambda name: plugin.ctx.ep.group if name in experts else None  # noqa: E731
    mb = local_batch // plugin_kwargs.get("num_microbatches", 1)
    dp, dp_rank = plugin.dp_size, plugin.dp_rank
    ref_params = dict(reference.get_base_model().named_parameters(remove_duplicate=False))
    base_params = dict(base.named_parameters(remove_duplicate=False))
    for step in range(steps):
        batch = mu.on_device(mu.make_batch(kind, local_batch * dp, seed=100 + step))
        replica = [{k: v[r * local_batch:(r + 1) * local_batch] for k, v in batch.items()} for r in range(dp)]
        ref_opt.zero_grad()
        ref_losses = [mu.microbatch_mean_loss(reference, b, mb) for b in replica]
        torch.stack(ref_losses).mean().backward()
        opt.zero_grad()
        if plugin.pp_size > 1:
            loss = booster.execute_pipeline(iter([replica[dp_rank]]), model, mu.criterion, opt)["loss"]
        else:
            loss = mu.criterion(model(**replica[dp_rank]), replica[dp_rank])
            booster.backward(loss, opt)
        mu.assert_close(loss.detach(), ref_losses[dp_rank].detach(), f"{kind} step {step} loss")
        opt.step()
        ref_grads = {n: p.grad.clone() for n, p in ref_params.items() if p.grad is not None}
        ref_opt.step()
        grads = opt.gathered_grads()
        for name, p in model.unwrap().named_parameters():
            assert p.requires_grad == ("lora_" in name), f"{kind}: {name} requires_grad={p.requires_grad}"
            if p.requires_grad:
                mu.assert_close(mu.gathered(p, grads[id(p)], tp_group), ref_grads[name],
                                f"{kind} step {step} grad of {name}")
            else:  # frozen base weights (also a tied embedding shared by stages) never change, not even by 1 ulp
                assert torch.equal(mu.gathered(p, p.data, tp_group, ep_of(name)),
                                   base_params[name.replace(".base_layer.", ".")]), f"{kind} step {step}: frozen {name} changed"
            mu.assert_close(mu.gathered(p, p.data, tp_group, ep_of(name)), ref_params[name].data,
                            f"{kind} step {step} {name}")
    return booster, model, base, reference


def _check_adapter_reloads(booster, model, base, reference, kind: str, path: str) -> None:
    """save_lora_as_pretrained writes a peft directory; plain peft loads it onto the unsharded model."""
    booster.save_lora_as_pretrained(model, path)
    assert sorted(f for f in os.listdir(path) if not f.startswith(".")) == ["adapter_config.json",
                                                                              "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    batch = mu.make_batch(kind, 2, seed=7)
    with torch.no_grad():
        mu.assert_close(loaded(**batch).logits, reference.eval()(**batch).logits, f"{kind}: reloaded adapter logits")
        assert not torch.allclose(loaded(**batch).logits, base.eval()(**batch).logits), "the adapter changes nothing"


def _check_save_model(booster, model, base, reference, path: str) -> None:
    """save_model of a LoRA model: the base weights under the base model's own names (from_pretrained reads them),
    the adapters under peft's; load_model restores the adapters."""
    booster.save_model(model, path)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and not any(".base_layer." in k for k in keys), keys
    assert "model.layers.3.mlp.down_proj.lora_B.default.weight" in keys
    if dist.get_rank() == 0:
        saved_base = LlamaForCausalLM.from_pretrained(path)
        for name, p in base.named_parameters():
            assert torch.equal(saved_base.get_parameter(name), p), name
    adapter = next(p for n, p in model.unwrap().named_parameters() if "lora_A" in n)
    with torch.no_grad():
        adapter.zero_()
    booster.load_model(model, path)
    ref_params = dict(reference.get_base_model().named_parameters())
    plugin = booster.plugin
    for name, p in model.unwrap().named_parameters():
        mu.assert_close(mu.gathered(p, p.data, plugin.tp_group), ref_params[name].data, f"load_model: {name}")


def _check_lazy_init_then_base_checkpoint(path: str) -> None:
    """Built on the meta device (LazyInitContext): the adapters get peft's init at boost (lora_B = 0), the base
    weights come from the base model's checkpoint, so the model starts as the base model does."""
    base = mu.build("llama_lm")
    if dist.get_rank() == 0:
        base.save_pretrained(path)
    dist.barrier()
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2))
    with torch.device("meta"):
        model = LlamaForCausalLM(mu.llama_config())
    model = booster.enable_lora(model, lora_config=LoraConfig(r=4, target_modules=TARGETS["llama_lm"]))
    model, *_ = booster.boost(model)
    booster.load_model(model, path)  # strict: the checkpoint has no adapters, which keep their values
    for name, p in model.unwrap().named_parameters():
        assert not p.is_meta and torch.isfinite(p).all(), name
        assert "lora_B" not in name or not p.any(), name
        assert "lora_A" not in name or p.abs().sum() > 0, name
    batch = mu.make_batch("llama_lm", 4, seed=3)
    model.eval()
    with torch.no_grad():
        out = booster.execute_pipeline(iter([batch]), model, mu.criterion, return_outputs=True)
        if booster.plugin.is_last_stage():
            mu.assert_close(out["outputs"]["logits"], base.eval()(**batch).logits, "lazy LoRA model's logits")


def _check_dropout_masks() -> None:
    """LoRA dropout on a column-parallel layer's (replicated) input draws the same mask on every tp rank; on a
    row-parallel layer's split input, a mask per rank."""
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2))
    model = booster.enable_lora(mu.build("llama_lm", layers=1), lora_config=_config("llama_lm", lora_dropout=0.5))
    model, *_ = booster.boost(model)
    attention = model.unwrap().model.layers[0].self_attn
    masks = {}
    for name in ("q_proj", "o_proj"):
        dropout = getattr(attention, name).lora_dropout["default"]
        dropout.register_forward_hook(lambda m, args, out, name=name: masks.__setitem__(name, out == 0))
    model.train()
    model(**mu.make_batch("llama_lm", 2, seed=0))
    for name, same in (("q_proj", True), ("o_proj", False)):
        parts = [torch.empty_like(masks[name]) for _ in range(2)]
        dist.all_gather(parts, masks[name], group=booster.plugin.tp_group)
        assert masks[name].any() and torch.equal(parts[0], parts[1]) == same, f"{name}: dropout masks"


def _check_refused(booster, boosted) -> None:
    """Bad uses raise clear errors on every rank, before any collective."""
    with pytest.raises(ValueError, match="before booster.boost"):
        booster.enable_lora(boosted, lora_config=_config("llama_lm"))
    for target, style in (("lm_head", "VocabHead"), ("embed_tokens", "VocabEmbedding")):
        model = enable_lora(mu.build("llama_lm"), lora_config=LoraConfig(r=4, target_modules=["q_proj", target]))
        plugin = HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2, parallel_output=False)
        with pytest.raises(LoRAShardingError, match=f"LoRA on '.*{target}'.*{style}.*target_modules"):
            Booster(plugin=plugin).boost(model)


def check_lora(tmp_dir: str) -> None:
    """The 4-rank checks (called from test_tensor_parallel's 4-rank group)."""
    for kind in ("llama_lm", "gpt2_lm"):
        booster, model, base, reference = _train_like_peft(kind, tp_size=2, pp_size=2, num_microbatches=2)
        _check_adapter_reloads(booster, model, base, reference, kind, os.path.join(tmp_dir, f"{kind}-adapter"))
        if kind == "llama_lm":
            _check_save_model(booster, model, base, reference, os.path.join(tmp_dir, "lora-model"))
            _check_refused(booster, model)
    booster, model, base, reference = _train_like_peft("llama_lm", tp_size=2, zero_stage=1)  # dp=2
    _check_adapter_reloads(booster, model, base, reference, "llama_lm", os.path.join(tmp_dir, "dp-adapter"))
    _check_lazy_init_then_base_checkpoint(os.path.join(tmp_dir, "base"))
    _check_dropout_masks()
    # zbv (pp=2 x dp=2): the adapters' nn.Linear go through the split backward's weight-gradient store
    _train_like_peft("gpt2_lm", pp_size=2, num_microbatches=2, pp_style="zbv", num_model_chunks=2)


# -- one process, no process group -----------------------------------------------------------------------------------
def test_enable_lora_refuses_bad_arguments():
    model = mu.build("llama_lm", layers=2)
    with pytest.raises(ValueError, match="needs lora_config"):
        Booster().enable_lora(model)
    with pytest.raises(TypeError, match="must be a peft.LoraConfig"):
        Booster().enable_lora(model, lora_config={"r": 4})
    with pytest.raises(NotImplementedError, match="Quantized LoRA"):
        Booster().enable_lora(model, lora_config=_config("llama_lm"), quantize=True)
    with pytest.raises(ValueError, match="already has peft adapters"):
        Booster().enable_lora(enable_lora(model, lora_config=_config("llama_lm")), lora_config=_config("llama_lm"))
