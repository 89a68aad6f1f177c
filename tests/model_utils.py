"""Tiny transformers models and the reference check every parallel layout must pass: the same losses, outputs,
gradients and parameters after AdamW steps as the unsharded model on one process, in fp32."""
from __future__ import annotations

import copy
import os
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from transformers import (OPTConfig, OPTForCausalLM, BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel, GPT2Config,
                          GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Model, LlamaConfig, LlamaForCausalLM,
                          LlamaForSequenceClassification, LlamaModel)

from booster_plugin import Booster, HybridParallelPlugin
from shardformer.layer.spec import gather_tensor, get_tp_spec
from shardformer.multimodal_batch import take_samples

VOCAB, SEQ = 100, 8  # a vocabulary no tp size divides, to exercise padding
DEVICE = torch.device("cpu")  # where references and batches live: the GPU in a world of one under HP_TEST_DEVICE=cuda


def on_device(batch: Dict[str, Any]) -> Dict[str, Any]:
    """The batch's tensors on DEVICE."""
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def gpt2_config(layers: int = 4) -> GPT2Config:
    return GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=layers, n_head=4, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def llama_config(layers: int = 4, **overrides) -> LlamaConfig:
    return LlamaConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
                                 pad_token_id=0), **overrides})


def bert_config(layers: int = 4) -> BertConfig:
    return BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, pad_token_id=0)


def opt_config(layers: int = 4) -> OPTConfig:
    return OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=layers, num_attention_heads=4,
                     max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, word_embed_proj_dim=32)


class OwnLoraEmbedding(torch.nn.Module):
    """A script's own LoRA embedding replacing nn.Embedding (as ColossalChat's LoraEmbedding): no tp plan fits it."""

    def __init__(self, embedding: torch.nn.Embedding, rank: int = 4) -> None:
        super().__init__()
        self.weight = embedding.weight
        self.lora_A = torch.nn.Parameter(torch.randn(rank, embedding.num_embeddings) * 0.1)
        self.lora_B = torch.nn.Parameter(torch.randn(embedding.embedding_dim, rank) * 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight + (self.lora_B @ self.lora_A).T)


def _own_lora_llama(layers: int) -> LlamaForCausalLM:
    model = LlamaForCausalLM(llama_config(layers, tie_word_embeddings=False))
    model.model.embed_tokens = OwnLoraEmbedding(model.model.embed_tokens)
    return model


class Registry(dict):
    """A table test modules add their kinds to: a kind registered twice from different places (two test modules
    sharing one long-lived worker) is refused, naming both; the same definition registered again (a module imported
    again) replaces itself."""

    @staticmethod
    def _site(value: object) -> object:
        code = getattr(value, "__code__", None)
        return (code.co_filename, code.co_firstlineno) if code is not None else value

    def __setitem__(self, key: str, value: object) -> None:
        if key in self and self._site(self[key]) != self._site(value):
            raise KeyError(f"test kind {key!r} is registered twice: {self._site(self[key])} and "
                           f"{self._site(value)}; give one of them a name of its own.")
        super().__setitem__(key, value)

    def update(self, *args, **kwargs) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


MODELS: Dict[str, Callable] = Registry({
    "llama_own_lora_lm": _own_lora_llama,
    "opt_lm": lambda n=4: OPTForCausalLM(opt_config(n)),
    "gpt2_lm": lambda n=4: GPT2LMHeadModel(gpt2_config(n)),
    "gpt2": lambda n=4: GPT2Model(gpt2_config(n)),
    "gpt2_cls": lambda n=4: GPT2ForSequenceClassification(gpt2_config(n)),
    "llama_lm": lambda n=4: LlamaForCausalLM(llama_config(n)),
    "llama": lambda n=4: LlamaModel(llama_config(n)),
    "llama_cls": lambda n=4: LlamaForSequenceClassification(llama_config(n)),
    # packed rows (make_batch): without a cache, as transformers needs to keep attention inside each document
    "llama_packed_lm": lambda n=4: LlamaForCausalLM(llama_config(n, use_cache=False)),
    # (with a cache transformers' mask does not isolate documents: sequence parallelism must do as it does)
    "llama_packed_cache_lm": lambda n=4: LlamaForCausalLM(llama_config(n, use_cache=True)),
    "bert": lambda n=4: BertModel(bert_config(n)),
    "bert_mlm": lambda n=4: BertForMaskedLM(bert_config(n)),
    "bert_cls": lambda n=4: BertForSequenceClassification(bert_config(n)),
})


def packed_batch(batch_size: int, seed: int, length: int = SEQ) -> Dict[str, torch.Tensor]:
    """Rows of whole documents of 1 to 5 tokens (booster_plugin.packing: position_ids restarting, no mask)."""
    from booster_plugin.packing import pack_documents
    g = torch.Generator().manual_seed(seed)
    docs = ([int(t) for t in torch.randint(1, VOCAB, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)]
            for _ in iter(int, 1))
    return next(pack_documents(docs, length, rows_per_batch=batch_size))


# kind -> (batch_size, seed) -> batch, for kinds whose inputs or labels the suffix rules below do not make
# (registered by test modules beside their MODELS entries, e.g. question answering's start/end positions)
BATCHES: Dict[str, Callable[[int, int], Dict[str, torch.Tensor]]] = Registry()
# kind -> criterion(outputs, batch) of both the reference and the boosted model, for kinds whose loss is not the
# model's `loss` alone (e.g. GPT-2's double heads: its LM loss plus its multiple-choice loss); default `criterion`
CRITERIA: Dict[str, Callable[[Any, Dict[str, Any]], torch.Tensor]] = Registry()
# kind -> which of its batches' inputs index images, not samples (shardformer.multimodal_batch.image_rows: a
# vision-language model's pixel values), for kinds whose batches carry them; slices of a batch go by `samples`
RAGGED: Dict[str, Callable] = Registry()


def samples(kind: Optional[str], batch: Dict[str, Any], start: int, end: int) -> Dict[str, Any]:
    """Samples [start, end) of a batch of `kind` (images with the samples they belong to)."""
    return take_samples(batch, start, end, RAGGED.get(kind))


def make_batch(kind: str, batch_size: int, seed: int) -> Dict[str, torch.Tensor]:
    if kind in BATCHES:
        return BATCHES[kind](batch_size, seed)
    if "_packed" in kind:  # e.g. "llama_packed_lm"
        return packed_batch(batch_size, seed)
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -3:] = 0  # some padding on the right of one sample
    input_ids[0, -3:] = 0
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if kind.endswith("_lm"):
        batch["labels"] = input_ids.masked_fill(attention_mask == 0, -100)
    elif kind.endswith("_mlm"):
        batch["labels"] = torch.where(torch.rand(input_ids.shape, generator=g) < 0.3, input_ids, -100)
    elif kind.endswith("_cls"):
        batch["labels"] = torch.randint(0, 2, (batch_size,), generator=g)
    return batch


def criterion(outputs, batch) -> torch.Tensor:
    """Loss from the model's own head where it has one; a simple function of the hidden states otherwise."""
    if getattr(outputs, "loss", None) is not None:
        return outputs.loss
    return outputs.last_hidden_state.float().sin().mean()  # not invariant under a final LayerNorm


def build(kind: str, layers: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    return MODELS[kind](layers)


def gathered(param: torch.Tensor, tensor: torch.Tensor, tp_group, ep_group=None) -> torch.Tensor:
    """The full tensor of `param` from this rank's shard `tensor`: over tp, then over ep for expert parameters
    (give `ep_group` only for those)."""
    spec = get_tp_spec(param)
    full = tensor if spec is None or tp_group is None else gather_tensor(tensor, spec, tp_group)
    if ep_group is None:
        return full
    parts = [torch.empty_like(full) for _ in range(torch.distributed.get_world_size(ep_group))]
    torch.distributed.all_gather(parts, full.contiguous(), group=ep_group)
    return torch.cat(parts)


def assert_close(actual, expected, what: str, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def microbatch_mean_loss(model, batch: Dict[str, torch.Tensor], microbatch_size: int,
                         kind: Optional[str] = None) -> torch.Tensor:
    """The loss of a batch as the pipeline defines it: the mean of its microbatches' losses."""
    ragged = RAGGED[kind](batch) if kind in RAGGED else {}
    size = next(v.shape[0] for k, v in batch.items() if k not in ragged)
    chunks = [samples(kind, batch, i, i + microbatch_size) for i in range(0, size, microbatch_size)]
    loss_fn = CRITERIA.get(kind, criterion)
    return torch.stack([loss_fn(model(**c), c) for c in chunks]).mean()


def check_training(kind: str, steps: int = 2, layers: int = 4, local_batch: int = 8, lr: float = 1e-3,
                   max_norm: float = 0.0, tol: float = 1e-5, save_to: Optional[str] = None,
                   resume_from: Optional[Tuple[str, int]] = None, prepare: Optional[Callable[[Any], None]] = None,
                   pre_steps: int = 0, **plugin_kwargs) -> None:
    """Train the boosted model and the unsharded reference on the same global batches and compare everything.

    `tol` loosens the comparison for mixed precision (the reference stays fp32). The gradients compared are those
    the optimizer stepped (fp32 masters, unscaled; with ZeRO all-gathered from the dp slices). `save_to`: save
    model and optimizer there at the end; `resume_from=(directory, n)`: load them (saved after step n) and train
    steps n..steps-1 (the reference trains all). `prepare(plugin)` runs after boosting (e.g. to set a schedule).
    `pre_steps`: the unsharded model and its optimizer first take that many steps in one process, and the boosted
    ones start from copies of them (an optimizer boosted with state, as ColossalAI allows)."""
    plugin = HybridParallelPlugin(max_norm=max_norm, **plugin_kwargs)
    booster = Booster(plugin=plugin)
    reference = build(kind, layers).to(DEVICE)
    model = copy.deepcopy(reference)
    # Adam's first update is lr * g / (|g| + eps): with the default eps=1e-8 a gradient element that is ~0 up to
    # fp32 rounding (summation order differs across layouts) can move by up to lr. eps=1e-6 bounds that gain to
    # lr / eps, so parameters can be compared at 1e-5 while every real gradient still drives an Adam-sized step.
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, eps=1e-6)
    loss_fn = CRITERIA.get(kind, criterion)
    for step in range(pre_steps):
        batch = on_device(make_batch(kind, local_batch, seed=50 + step))
        ref_opt.zero_grad()
        loss_fn(reference(**batch), batch).backward()
        ref_opt.step()
    model = copy.deepcopy(reference)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6)
    if pre_steps:
        opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # (torch shares tensors otherwise)
    model, opt, *_ = booster.boost(model, opt, loss_fn)
    if prepare is not None:
        prepare(plugin)
    reference.train()
    model.train()
    tp_group = plugin.tp_group if plugin.tp_size > 1 else None
    experts = model.info.expert_params  # split over ep: gathered over the ep group too
    ep_of = lambda name: plugin.ctx.ep.group if name in experts else None  # noqa: E731
    mb = plugin_kwargs.get("microbatch_size") or local_batch // plugin_kwargs.get("num_microbatches", 1)
    dp, dp_rank = plugin.dp_size, plugin.dp_rank
    if resume_from is not None:
        booster.load_model(model, os.path.join(resume_from[0], "model"))
        booster.load_optimizer(opt, os.path.join(resume_from[0], "optimizer"))
    for step in range(steps):
        global_batch = on_device(make_batch(kind, local_batch * dp, seed=100 + step))
        local = samples(kind, global_batch, dp_rank * local_batch, (dp_rank + 1) * local_batch)
        # reference: one process, the whole global batch; the loss of a batch is the mean over its microbatches
        # (equal to the plain batch loss when microbatches hold equally many loss tokens) and over dp replicas
        ref_opt.zero_grad()
        ref_losses = [microbatch_mean_loss(reference, samples(kind, global_batch, r * local_batch,
                                                              (r + 1) * local_batch), mb, kind) for r in range(dp)]
        ref_loss = torch.stack(ref_losses).mean()
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm) if max_norm > 0 else None
        if resume_from is not None and step < resume_from[1]:  # the boosted model resumes from a checkpoint
            ref_opt.step()
            continue
        ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters(remove_duplicate=False) if p.grad is not None}

        opt.zero_grad()
        if plugin.pp_size > 1 or plugin.schedule is not None:
            out = booster.execute_pipeline(iter([local]), model, loss_fn, opt, return_loss=True)
            loss = out["loss"]
        else:
            loss = loss_fn(model(**local), local)
            booster.backward(loss, opt)
        assert_close(loss.detach().float(), ref_losses[dp_rank].detach(), f"{kind} step {step} loss", tol)
        opt.step()  # reduces gradients over stages and replicas, clips, steps
        ref_opt.step()
        if ref_norm is not None:
            assert_close(torch.tensor(opt.get_grad_norm()), ref_norm.float().cpu(), f"{kind} step {step} gradient norm", tol)
        stepped_grads = opt.gathered_grads()  # (p.grad with fp32 and zero_stage=0)
        for name, p in model.unwrap().named_parameters():
            grad = stepped_grads.get(id(p))
            if name not in ref_grads:  # unused by this loss (e.g. BERT's pooler): no gradient here either
                assert grad is None, f"{kind}: unused {name} got a gradient"
                continue
            assert grad is not None, f"{kind}: held parameter {name} got no gradient"
            assert_close(gathered(p, grad.float(), tp_group, ep_of(name)), ref_grads[name],
                         f"{kind} step {step} grad of {name}", tol)
        ref_params = dict(reference.named_parameters(remove_duplicate=False))
        for name, p in model.unwrap().named_parameters():
            assert_close(gathered(p, p.data.float(), tp_group, ep_of(name)), ref_params[name].data,
                         f"{kind} step {step} param {name}", tol)
    if save_to is not None:
        booster.save_model(model, os.path.join(save_to, "model"))
        booster.save_optimizer(opt, os.path.join(save_to, "optimizer"))


def check_evaluation(kind: str, layers: int = 4, local_batch: int = 8, **plugin_kwargs) -> None:
    """Forward-only pipeline evaluation returns the reference loss on every rank and its outputs on the last stage."""
    plugin = HybridParallelPlugin(**plugin_kwargs)
    booster = Booster(plugin=plugin)
    reference = build(kind, layers).to(DEVICE).eval()
    model, *_ = booster.boost(copy.deepcopy(reference))
    model.eval()
    batch = on_device(make_batch(kind, local_batch * plugin.dp_size, seed=7))
    local = samples(kind, batch, plugin.dp_rank * local_batch, (plugin.dp_rank + 1) * local_batch)
    with torch.no_grad():
        expected = reference(**local)
        out = booster.execute_pipeline(iter([local]), model, criterion, return_loss=True, return_outputs=True)
        mb = plugin_kwargs.get("microbatch_size") or local_batch // plugin_kwargs.get("num_microbatches", 1)
        expected_loss = microbatch_mean_loss(reference, local, mb, kind)
    assert_close(out["loss"], expected_loss, f"{kind} eval loss")
    if plugin.is_last_stage():
        key = "logits" if "logits" in expected else "last_hidden_state"
        assert_close(out["outputs"][key], expected[key], f"{kind} eval {key}")
    else:
        assert out["outputs"] is None
