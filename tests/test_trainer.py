"""HybridParallelTrainer: `transformers.Trainer.train()` on the plugin equals a plain one-process Trainer with the same
arguments (the one-process batch holding every replica's rows): logged losses, grad norms and learning rates, the
parameters at the end (through `save_model` + `from_pretrained`) and `evaluate()`'s loss, at tp=2 x pp=2, pp=2 x dp=2
with ZeRO-1, tp=2 x dp=2 with ZeRO-1 (no pipeline: booster.backward per batch), ring attention over sp=2 x dp=2,
Ulysses over sp=2 x pp=2 and Qwen3-MoE's experts over ep=2 x pp=2 and ep=2 x tp=2 with its router loss (4 ranks), with
gradient accumulation, a warm-up scheduler, weight decay, clipping, and labels with ignored positions (token-weighted
loss over the accumulation window and the replicas); checkpoints (`save_steps`, `save_total_limit`); a run stopped
after step 10 of 20 resumed into the same and into another layout; `load_best_model_at_end` with early stopping."""
import os
import sys

import pytest
import torch
import transformers
from transformers import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments

from hp_check.tiny import tiny_config
from tests import model_utils as mu
from tests.dist_utils import run_distributed

METRICS = ("eval_loss", "eval_accuracy", "eval_rows", "eval_logit_abs")
ROWS, EVAL_ROWS, STEPS, ACCUMULATION, BATCH = 48, 16, 6, 2, 2  # BATCH: rows per replica and Trainer batch
LONG_STEPS = 20  # the kill-and-resume run (12 steps per epoch at dp=1)


def _dataset(rows: int, seed: int) -> list:
    """Fixed-length rows whose labels ignore a varying number of positions (-100), so that microbatches and
    replicas hold different numbers of loss tokens."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for i in range(rows):
        ids = torch.randint(1, mu.VOCAB, (mu.SEQ,), generator=g)
        labels = ids.clone()
        labels[: i % 5] = -100
        data.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return data


def _args(output_dir: str, batch: int, **overrides) -> TrainingArguments:
    return TrainingArguments(**{**dict(
        output_dir=output_dir, per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
        gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=3e-3, weight_decay=0.1,
        warmup_steps=2, lr_scheduler_type="linear", max_grad_norm=0.5, adam_epsilon=1e-6, logging_steps=1,
        report_to="none", save_strategy="no", seed=7, use_cpu=True, disable_tqdm=True), **overrides})


class HalfLossTrainer(Trainer):
    """A Trainer subclass with its own compute_loss, as user and library trainers have (composition check)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        return (loss * 0.5, outputs) if return_outputs else loss * 0.5


class SplitForwardTrainer(Trainer):
    """One process making the plugin's forwards: every `forward_rows` rows of a batch their own forward, the losses
    summed. Under pp=2 the plugin splits a replica's window (and eval batch) into one-row microbatches; without pp
    each replica's batch (BATCH rows) is a forward; it sums their losses (each the model's own, with the global
    `num_items_in_batch`). The router's load-balancing loss of a forward depends on the tokens it sees, so one
    forward over all rows would give another loss."""
    forward_rows = 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rows, step = inputs["input_ids"].shape[0], self.forward_rows
        parts = [super(SplitForwardTrainer, self).compute_loss(
            model, {k: v[i:i + step] for k, v in inputs.items()}, return_outputs=True,
            num_items_in_batch=num_items_in_batch) for i in range(0, rows, step)]
        loss = sum(part[0] for part in parts)
        return (loss, {"logits": torch.cat([part[1].logits for part in parts])}) if return_outputs else loss


class ReplicaForwardTrainer(SplitForwardTrainer):
    forward_rows = BATCH


def _metrics(prediction) -> dict:
    """compute_metrics: next-token accuracy, the number of rows and the mean |logit| (full logits)."""
    logits, labels = torch.as_tensor(prediction.predictions), torch.as_tensor(prediction.label_ids)
    mask = labels[:, 1:] != -100
    hits = (logits[:, :-1].argmax(-1) == labels[:, 1:])[mask]
    return {"accuracy": hits.float().mean().item(), "rows": float(logits.shape[0]),
            "logit_abs": logits.abs().mean().item()}


def _logs(trainer) -> dict:
    steps = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return {key: [h[key] for h in steps] for key in ("loss", "grad_norm", "learning_rate")}


def _on_cpu(state: dict) -> dict:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def _reference(output_dir: str, replicas: int, trainer_class=Trainer, model=None, **arg_overrides) -> dict:
    """One process, plain Trainer, the same arguments with every replica's rows in its batch (parameters kept on
    the CPU: the reference may train on the GPU)."""
    model = model if model is not None else mu.build("llama_lm")
    initial = _on_cpu(model.state_dict())
    trainer = trainer_class(model=model, args=_args(output_dir, BATCH * replicas, **arg_overrides),
                            train_dataset=_dataset(ROWS, 1), eval_dataset=_dataset(EVAL_ROWS, 2))
    before = trainer.evaluate()["eval_loss"]
    trainer.compute_metrics = _metrics
    metrics = {k: v for k, v in trainer.evaluate().items() if k in METRICS}
    trainer.compute_metrics = None
    trainer.train()
    return {"initial": initial, "config": model.config, "model_class": type(model), "logs": _logs(trainer),
            "eval_before": before, "metrics": metrics, "eval_after": trainer.evaluate()["eval_loss"],
            "final": _on_cpu(model.state_dict())}


def _model(reference: dict):
    model = reference["model_class"](reference["config"])
    model.load_state_dict(reference["initial"])
    return model


def _train_reference(output_dir: str, base: dict, batch: int, callbacks=(), **arg_overrides) -> dict:
    """One process, plain Trainer, training only (`base`'s model and initial parameters)."""
    model = _model(base)
    trainer = Trainer(model=model, args=_args(output_dir, batch, **arg_overrides), train_dataset=_dataset(ROWS, 1),
                      eval_dataset=_dataset(EVAL_ROWS, 2), callbacks=list(callbacks))
    trainer.train()
    best = trainer.state.best_model_checkpoint
    return {**base, "logs": _logs(trainer), "final": {k: v.clone() for k, v in model.state_dict().items()},
            "global_step": trainer.state.global_step, "best": best and os.path.basename(best)}


def _trainer(plugin_kwargs: dict, reference: dict, output_dir: str, trainer_class=None, callbacks=(),
             batch: int = BATCH, **arg_overrides):
    from booster_plugin import HybridParallelPlugin, HybridParallelTrainer

    return (trainer_class or HybridParallelTrainer)(
        model=_model(reference), args=_args(output_dir, batch, **arg_overrides), train_dataset=_dataset(ROWS, 1),
        eval_dataset=_dataset(EVAL_ROWS, 2), callbacks=list(callbacks), plugin=HybridParallelPlugin(**plugin_kwargs))


def _check_trained(trainer, reference: dict, what: str) -> None:
    """Logged loss, grad norm, learning rate of every step, and the final parameters (saved, from_pretrained)."""
    logs, expected = _logs(trainer), reference["logs"]
    assert len(logs["loss"]) == len(expected["loss"]), logs
    for key in ("loss", "grad_norm", "learning_rate"):
        mu.assert_close(torch.tensor(logs[key]), torch.tensor(expected[key]), f"{what}: logged {key}")
    assert max(expected["grad_norm"]) > 0.5, "the test should clip"
    saved = os.path.join(trainer.args.output_dir, "final")
    trainer.save_model(saved)
    loaded = type(trainer.model).from_pretrained(saved)
    for name, value in loaded.state_dict().items():
        mu.assert_close(value, reference["final"][name], f"{what}: {name} at the end (from_pretrained)")


def _check_layout(plugin_kwargs: dict, reference: dict, output_dir: str, trainer_class=None, **arg_overrides):
    trainer = _trainer(plugin_kwargs, reference, output_dir, trainer_class, **arg_overrides)
    what = f"{plugin_kwargs}"
    mu.assert_close(torch.tensor(trainer.evaluate()["eval_loss"]), torch.tensor(reference["eval_before"]),
                    f"{what}: eval loss before training")
    if "zero_stage" in plugin_kwargs:  # full logits for compute_metrics (dp=2: gathered over replicas only)
        trainer.compute_metrics = _metrics
        metrics = trainer.evaluate()
        for key in METRICS:
            mu.assert_close(torch.tensor(metrics[key]), torch.tensor(reference["metrics"][key]), f"{what}: {key}")
        trainer.compute_metrics = None
    trainer.train()
    mu.assert_close(torch.tensor(trainer.evaluate()["eval_loss"]), torch.tensor(reference["eval_after"]),
                    f"{what}: eval loss after training")
    _check_trained(trainer, reference, what)


def _check_refusals(reference: dict, directory: str) -> None:
    """Trainer options acting on the unsharded model behind the plugin: refused on every rank, naming the fix."""
    from booster_plugin.trainer.compat import checkpointing_argument
    from shardformer.stage.loss_weights import causal_lm_label_tokens

    with pytest.raises(ValueError, match="drop loss_weight_fn"):
        _trainer(dict(pp_size=2, loss_weight_fn=causal_lm_label_tokens), reference, directory)
    for overrides, fix in (({checkpointing_argument(): True}, "gradient_checkpoint_config"),
                           (dict(use_cpu=False), "use_cpu=True"),
                           (dict(max_grad_norm=2.0), "set one of them")):
        plugin = dict(pp_size=2, max_norm=1.0) if "max_grad_norm" in overrides else dict(pp_size=2)
        with pytest.raises(ValueError, match=fix):
            _trainer(plugin, reference, directory, **overrides)


# evaluated and saved every 2 steps; the eval loss (other random rows) rises after step 2, so early stopping
# (patience 1) stops at step 4, then the best checkpoint (step 2) is loaded back
BEST = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
            metric_for_best_model="eval_loss")


def _check_best_model(reference: dict, output_dir: str) -> None:
    """load_best_model_at_end and EarlyStoppingCallback at tp=2 x pp=2: the same stop, best checkpoint and logs as
    one process, and the best checkpoint's parameters loaded back through the booster (tp shards, pp stages)."""
    trainer = _trainer(dict(tp_size=2, pp_size=2), reference, output_dir,
                       callbacks=[EarlyStoppingCallback(early_stopping_patience=1)], **BEST)
    trainer.train()
    assert (trainer.state.global_step, os.path.basename(trainer.state.best_model_checkpoint)) == \
        (reference["global_step"], reference["best"]) == (4, "checkpoint-2"), trainer.state
    _check_trained(trainer, reference, "best model after early stopping")


class StopAfter(TrainerCallback):
    """Ends training after `step` (the checkpoint of that step saved), as a killed job would have left it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def _check_resumed(reference: dict, directory: str) -> None:
    """LONG_STEPS steps (crossing into the second epoch) stopped after step LONG_STEPS / 2 at tp=2 x pp=2, then
    resumed by fresh trainers into the same layout and into pp=2 x dp=2 with ZeRO-1 (one row per replica: the same
    global batch): the resumed runs log the uninterrupted run's steps (the first half from the checkpoint's trainer
    state) and end with its parameters: optimizer state, scheduler and data position restored."""
    half, killed = LONG_STEPS // 2, os.path.join(directory, "killed")
    trainer = _trainer(dict(tp_size=2, pp_size=2), reference, killed, callbacks=[StopAfter(half)],
                       max_steps=LONG_STEPS, save_strategy="steps", save_steps=half)
    trainer.train()
    assert trainer.state.global_step == half and os.listdir(killed) == [f"checkpoint-{half}"], os.listdir(killed)
    for name, plugin_kwargs, batch in (("tp2pp2", dict(tp_size=2, pp_size=2), BATCH),
                                       ("pp2dp2", dict(pp_size=2, zero_stage=1), BATCH // 2)):
        resumed = _trainer(plugin_kwargs, reference, os.path.join(directory, "resumed", name), batch=batch,
                           max_steps=LONG_STEPS)
        resumed.train(resume_from_checkpoint=os.path.join(killed, f"checkpoint-{half}"))
        _check_trained(resumed, reference, f"resumed after step {half} from tp=2 x pp=2 into {plugin_kwargs}")


def _layouts(references: dict, directory: str) -> None:
    _check_refusals(references[1], os.path.join(directory, "refused"))
    _check_layout(dict(tp_size=2, pp_size=2), references[1], os.path.join(directory, "tp2pp2"))
    # checkpoints every 2 steps, the last 2 kept
    saving = os.path.join(directory, "pp2dp2")
    _check_layout(dict(pp_size=2, zero_stage=1), references[2], saving, save_strategy="steps", save_steps=2,
                  save_total_limit=2)
    assert sorted(os.listdir(saving)) == ["checkpoint-4", "checkpoint-6", "final"], os.listdir(saving)
    # sequence parallelism: ring attention over sp=2 x dp=2, Ulysses over sp=2 x pp=2 (sp ranks share a batch)
    _check_layout(dict(sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="ring_attn"),
                  references[2], os.path.join(directory, "ring2dp2"))
    _check_layout(dict(sp_size=2, pp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all"),
                  references[1], os.path.join(directory, "ulysses2pp2"))
    # expert parallelism: Qwen3-MoE's experts over ep=2 (dp=2) x pp=2, ZeRO-1
    _check_layout(dict(pp_size=2, ep_size=2, zero_stage=1), references["moe"], os.path.join(directory, "pp2ep2"))
    _check_layout(dict(tp_size=2, ep_size=2), references["moe_pp1"], os.path.join(directory, "tp2ep2"))  # pp=1
    # tp=2 x dp=2 (pp=1), ZeRO-1: the mixin on a Trainer subclass with its own compute_loss (under pp such an override
    # is refused)
    from booster_plugin import HybridParallelTrainerMixin

    class Composed(HybridParallelTrainerMixin, HalfLossTrainer):
        pass

    _check_layout(dict(tp_size=2, zero_stage=1), references["half"], os.path.join(directory, "composed"), Composed)
    with pytest.raises(ValueError, match="compute_loss override"):
        _trainer(dict(pp_size=2), references["half"], os.path.join(directory, "refused"), Composed)
    _check_best_model(references["best"], os.path.join(directory, "best"))
    _check_resumed(references["long"], os.path.join(directory, "resume"))


def test_trainer_equals_one_process(tmp_path):
    references = {replicas: _reference(str(tmp_path / f"ref{replicas}"), replicas) for replicas in (1, 2)}
    references["half"] = _reference(str(tmp_path / "ref_half"), 2, HalfLossTrainer)
    torch.manual_seed(0)  # a Qwen3-MoE with its router loss, against one process doing the pipeline's forwards
    moe = transformers.Qwen3MoeForCausalLM(tiny_config(
        transformers.Qwen3MoeConfig, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, vocab_size=mu.VOCAB,
        output_router_logits=True, router_aux_loss_coef=1.0))
    initial = {k: v.clone() for k, v in moe.state_dict().items()}
    references["moe"] = _reference(str(tmp_path / "ref_moe"), 2, SplitForwardTrainer, model=moe)
    moe.load_state_dict(initial)
    references["moe_pp1"] = _reference(str(tmp_path / "ref_moe_pp1"), 2, ReplicaForwardTrainer, model=moe)
    references["best"] = _train_reference(str(tmp_path / "ref_best"), references[1], BATCH,
                                          [EarlyStoppingCallback(early_stopping_patience=1)], **BEST)
    references["long"] = _train_reference(str(tmp_path / "ref_long"), references[1], BATCH, max_steps=LONG_STEPS)
    run_distributed(4, _layouts, references, str(tmp_path))


def test_import_is_lazy():
    import subprocess
    code = ("import sys, booster_plugin; assert 'transformers.trainer' not in sys.modules, 'eager'; "
            "assert 'accelerate' not in sys.modules, 'eager'; "
            "from booster_plugin import HybridParallelTrainer; assert 'transformers.trainer' in sys.modules; "
            "assert 'trl' not in sys.modules, 'TRL imported by the Trainer integration'")
    subprocess.run([sys.executable, "-c", code], check=True)
