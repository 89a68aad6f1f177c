"""TRL's SFTTrainer and DPOTrainer with HybridParallelTrainerMixin equal their one-process runs (the one-process batch
holding every replica's rows): logged loss, grad norm and learning rate of every step (and TRL's own metrics: entropy,
token accuracy, token count, DPO's rewards, log-probabilities and mean logits, without pp) and the trainable
parameters at the end, 1e-5, fp32. SFTTrainer with completion-only loss on packed, padding-free rows (position_ids
restarting per document) at tp=2 x pp=2, Ulysses over sp=2 x pp=2 and ring attention over sp=2 x dp=2, LoRA through
`peft_config` with assistant-only loss (a chat template's generation marks) at tp=2 x dp=2 (ZeRO-1); DPOTrainer
(policy and reference model on the plugin, chosen and rejected in one step) at tp=2 x dp=2 (ZeRO-1), and under pp
(one pipeline step per window, pairs kept whole in microbatches; its reward and log-probability metrics) at tp=2 x
pp=2 and pp=2 x dp=2 (ZeRO-1)."""
import os
from typing import Optional

import pytest
import torch
import transformers
import trl  # the test extra's (setup.py): a missing trl fails here rather than skipping
from datasets import Dataset  # trl's own dependency

from hp_check.tiny import tiny_config
from tests import model_utils as mu
from tests.dist_utils import run_distributed

STEPS, ACCUMULATION, BATCH, MAX_LENGTH = 3, 2, 2, 16


# a chat template marking the assistant's tokens (`{% generation %}`), for SFTConfig(assistant_only_loss=True)
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <eos> "
                 "{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}{% endfor %}")


def _tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary ("w3" is id 3) with a chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i for i in range(3, mu.VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", chat_template=CHAT_TEMPLATE)


def _words(g: torch.Generator, low: int, high: int) -> str:
    n = int(torch.randint(low, high, (1,), generator=g))
    return " ".join(f"w{int(i)}" for i in torch.randint(3, mu.VOCAB, (n,), generator=g))


def _completions(rows: int, seed: int = 1) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"prompt": _words(g, 2, 6), "completion": " " + _words(g, 2, 7)} for _ in range(rows)])


def _conversations(rows: int, seed: int = 3) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"messages": [{"role": "user", "content": _words(g, 2, 6)},
                                            {"role": "assistant", "content": _words(g, 2, 6)}]} for _ in range(rows)])


def _preferences(rows: int, seed: int = 2) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"prompt": _words(g, 2, 5), "chosen": " " + _words(g, 1, 5),
                               "rejected": " " + _words(g, 1, 5)} for _ in range(rows)])


def _common(output_dir: str, batch: int) -> dict:
    return dict(output_dir=output_dir, per_device_train_batch_size=batch, gradient_accumulation_steps=ACCUMULATION,
                max_steps=STEPS, learning_rate=3e-3, weight_decay=0.1, warmup_steps=1, lr_scheduler_type="linear",
                max_grad_norm=0.15, logging_steps=1, report_to="none", save_strategy="no", seed=7, use_cpu=True,
                disable_tqdm=True, dataloader_drop_last=True,
                gradient_checkpointing=False, bf16=False)  # TRL defaults to both: the plugin has its own


def _sft_config(output_dir: str, batch: int, **overrides):
    # packed rows of at most MAX_LENGTH tokens, flattened per batch (padding-free) and padded to one length (pp
    # stacks a window's batches; ring attention needs a multiple of 2 x sp)
    return trl.SFTConfig(**_common(output_dir, batch), packing=True, max_length=MAX_LENGTH,
                         pad_to_multiple_of=MAX_LENGTH * batch, **overrides)


def _dpo_config(output_dir: str, batch: int, loss_type: str):
    # padded to one length: pp stacks a window's batches
    return trl.DPOConfig(**_common(output_dir, batch), beta=0.2, loss_type=[loss_type], pad_to_multiple_of=MAX_LENGTH)


def _lora():
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])


def _logs(trainer) -> dict:
    """Every value logged at each step (TRL adds its metrics: entropy, token accuracy, DPO's rewards, ...)."""
    steps = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return {key: [h[key] for h in steps] for key in steps[0]}


def _trainable(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class Run:
    """One trainer kind: how to build it (one process or on a plugin) from the same initial model."""

    def __init__(self, kind: str, lora: bool = False, model_kind: str = "llama_packed_lm") -> None:
        self.kind, self.lora, self.model_kind = kind, lora, model_kind
        self.initial = mu.build(model_kind).state_dict()

    def model(self):
        model = mu.build(self.model_kind, seed=1)
        model.load_state_dict(self.initial)
        return model

    def trainer(self, output_dir: str, batch: int, trainer_class, loss_type: Optional[str] = None, rows: int = 64,
                **extra):
        kwargs = dict(model=self.model(), processing_class=_tokenizer(), **extra)
        if self.kind == "sft" and not self.lora:  # completion-only loss (prompt-completion rows)
            kwargs.update(args=_sft_config(output_dir, batch, loss_type=loss_type or "nll"),
                          train_dataset=_completions(rows))
        elif self.kind == "sft":  # assistant-only loss (conversations), LoRA adapters
            kwargs.update(args=_sft_config(output_dir, batch, assistant_only_loss=True),
                          train_dataset=_conversations(rows), peft_config=_lora())
        else:
            kwargs.update(args=_dpo_config(output_dir, batch, loss_type or "sigmoid"), train_dataset=_preferences(rows),
                          ref_model=self.model())
        return trainer_class(**kwargs)

    def reference(self, output_dir: str, replicas: int) -> dict:
        base = trl.SFTTrainer if self.kind == "sft" else trl.DPOTrainer
        trainer = self.trainer(output_dir, BATCH * replicas, base)
        trainer.train()
        return {"logs": _logs(trainer), "final": _trainable(trainer.model)}


def _check(run: Run, reference: dict, plugin_kwargs: dict, output_dir: str) -> None:
    from booster_plugin import HybridParallelDPOTrainer, HybridParallelPlugin, HybridParallelSFTTrainer

    cls = HybridParallelSFTTrainer if run.kind == "sft" else HybridParallelDPOTrainer
    trainer = run.trainer(output_dir, BATCH, cls, plugin=HybridParallelPlugin(**plugin_kwargs))
    trainer.train()
    what = f"{run.kind}{' lora' if run.lora else ''} {plugin_kwargs}"
    logs, expected = _logs(trainer), reference["logs"]
    assert len(logs["loss"]) == STEPS, logs
    # TRL's metrics come from its compute_loss, which the pipeline replaces by the model's own loss (SFT) or the
    # DPO criterion (its reward and log-probability metrics) under pp
    keys = expected if plugin_kwargs.get("pp_size", 1) == 1 else ("loss", "grad_norm", "learning_rate")
    if run.kind == "dpo" and plugin_kwargs.get("pp_size", 1) > 1:  # DPO's criterion counts its pairs' metrics
        keys = (*keys, *[key for key in expected if key.startswith(("rewards/", "logps/"))])
    assert set(keys) <= set(logs), (sorted(keys), sorted(logs))
    for key in keys:
        mu.assert_close(torch.tensor(logs[key]), torch.tensor(expected[key]), f"{what}: logged {key}")
    assert max(expected["grad_norm"]) > 0.15, "the test should clip"
    if run.kind == "dpo" and plugin_kwargs.get("pp_size", 1) > 1:
        with pytest.raises(ValueError, match="evaluate\\(\\) / predict\\(\\) under pp_size > 1"):
            trainer.prediction_step(trainer.model_wrapped, {}, prediction_loss_only=True)
    model = trainer.model_wrapped
    experts = model.info.expert_params  # (their names): split over ep as well
    for name, param in model.unwrap(unwrap_peft=False).named_parameters():
        if param.requires_grad:
            expected = reference["final"][name]
            full = mu.gathered(param, param.detach(), trainer.plugin.tp_group,
                               trainer.plugin.ctx.ep.group if name in experts else None)
            full = full[tuple(slice(0, size) for size in expected.shape)]  # vocabulary padding dropped
            mu.assert_close(full, expected, f"{what}: {name} after {STEPS} steps")


def _check_refusals(runs: dict, directory: str) -> None:
    """Refused on every rank (before the plugin's first collective), naming the fix."""
    from booster_plugin import HybridParallelPlugin, HybridParallelSFTTrainer, HybridParallelTrainerMixin

    class DPO(HybridParallelTrainerMixin, trl.DPOTrainer):  # the mixin on TRL's own class
        pass

    sequence_parallel = dict(sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all")
    with pytest.raises(ValueError, match="loss_type=\\['ipo'\\].*use loss_type='sigmoid'.*sequence parallelism "
                                         "\\('all_to_all'\\) under pp_size > 1"):
        runs["dpo"].trainer(directory, BATCH, DPO, rows=4, loss_type="ipo",
                            plugin=HybridParallelPlugin(pp_size=2, num_microbatches=2, **sequence_parallel))
    with pytest.raises(ValueError, match="would split \\(chosen, rejected\\) pairs.*num_microbatches="):
        runs["dpo"].trainer(directory, BATCH, DPO, rows=4, plugin=HybridParallelPlugin(pp_size=2))
    with pytest.raises(ValueError, match="use loss_type='nll'"):
        runs["sft"].trainer(directory, BATCH, HybridParallelSFTTrainer, rows=4, loss_type="dft",
                            plugin=HybridParallelPlugin(pp_size=2))


def _layouts(runs: dict, references: dict, directory: str) -> None:
    _check_refusals(runs, os.path.join(directory, "refused"))
    _check(runs["sft"], references["sft", 1], dict(tp_size=2, pp_size=2), os.path.join(directory, "sft_tp2pp2"))
    _check(runs["sft"], references["sft", 1], dict(sp_size=2, pp_size=2, enable_sequence_parallelism=True,
                                                   sequence_parallelism_mode="all_to_all"),
           os.path.join(directory, "sft_ulysses2pp2"))
    _check(runs["sft"], references["sft", 2], dict(sp_size=2, enable_sequence_parallelism=True,
                                                   sequence_parallelism_mode="ring_attn"),
           os.path.join(directory, "sft_ring2dp2"))
    _check(runs["lora"], references["lora", 2], dict(tp_size=2, zero_stage=1), os.path.join(directory, "lora"))
    # Qwen3-MoE's experts over ep=2 (dp=2) x pp=2, ZeRO-1, packed rows
    _check(runs["moe"], references["moe", 2], dict(ep_size=2, pp_size=2, zero_stage=1), os.path.join(directory, "moe"))
    _check(runs["dpo"], references["dpo", 2], dict(tp_size=2, zero_stage=1), os.path.join(directory, "dpo"))
    _check(runs["dpo"], references["dpo", 1], dict(tp_size=2, pp_size=2, num_microbatches=2),
           os.path.join(directory, "dpo_tp2pp2"))
    _check(runs["dpo"], references["dpo", 2], dict(pp_size=2, zero_stage=1, microbatch_size=2),
           os.path.join(directory, "dpo_pp2dp2"))


# a mixture-of-experts model for SFT under expert parallelism (no router loss: TRL's own is refused, see README);
# a key of its own: other test modules register their MoE kinds in the same table
mu.MODELS["trl_qwen3moe_lm"] = lambda n=4: transformers.Qwen3MoeForCausalLM(tiny_config(
    transformers.Qwen3MoeConfig, num_hidden_layers=n, num_experts=4, num_experts_per_tok=2, vocab_size=mu.VOCAB,
    use_cache=False, router_aux_loss_coef=0.0))


def test_trl_trainers_equal_one_process(tmp_path):
    runs = {"sft": Run("sft"), "lora": Run("sft", lora=True), "dpo": Run("dpo"),
            "moe": Run("sft", model_kind="trl_qwen3moe_lm")}
    references = {(name, replicas): runs[name].reference(str(tmp_path / f"ref_{name}{replicas}"), replicas)
                  for name, replicas in (("sft", 1), ("sft", 2), ("lora", 2), ("dpo", 2), ("dpo", 1), ("moe", 2))}
    run_distributed(4, _layouts, runs, references, str(tmp_path))

