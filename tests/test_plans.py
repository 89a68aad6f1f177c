"""Models without a hand-written policy train exactly through the policy derived from their transformers plans:
a handful that exercise different features, under tp, pp and tp x pp, against the unsharded model."""
import pytest
import transformers

from hp_check.cli import main as check_main
from hp_check.compare import compare
from hp_check.tiny import tiny_config
from shardformer.policies import Colwise, Policy, PlanRefused, Rowwise, VocabEmbedding, VocabHead, get_autopolicy
from shardformer.policies.base import INPUT
from tests import model_utils as mu
from tests.dist_utils import run_distributed

# family -> what it exercises
FAMILIES = {
    "Qwen3": "per-head q/k norms (replicated_with_grad_allreduce)",
    "Gemma": "embedding scaled inside its module, tied LM head",
    "Olmo2": "q/k norms over the whole projection (colwise_gather_output + rowwise_split_input)",
    "Granite": "embedding multiplier in the model's forward, residual/attention/logit multipliers",
    "Phi": "partial rotary, biases, embedding dropout entry module, final_layernorm exit",
    "Cohere": "parallel attention/MLP block, logit scale, tied head",
    "Gemma2": "sliding/full layer types per layer, soft-capping",
}
OVERRIDES = {"Granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3,
                             logits_scaling=2.0)}
for _family in FAMILIES:
    mu.MODELS[f"{_family.lower()}_lm"] = (
        lambda n=4, f=_family: getattr(transformers, f"{f}ForCausalLM")(
            tiny_config(getattr(transformers, f"{f}Config"), num_hidden_layers=n, **OVERRIDES.get(f, {}))))
KINDS = [f"{f.lower()}_lm" for f in FAMILIES]
# family -> what it exercises, checked with `compare` at (tp, pp) = (2, 2)
COMPARED = {
    "Nemotron": "no pipeline plan: the split derived from the base model's structure",
    "MiniCPM3": "latent attention (mla_kv_a_proj); replicated modules reading an attention region's input",
    "Phi4Multimodal": "encoders no stage has a gradient for, kept on every stage (no AdamW step for them)",
    "Qwen2Moe": "experts split over tp (moe_tp_experts: stacked gate|up by columns, down by rows), replicated router "
                "and shared expert",
    "DeepseekV3": "a router beside column-parallel shared experts (its gradient is not summed), dense first layers",
}
# 4 query heads, 2 key/value heads (with biases): tp=4 replicates each kv head on 2 ranks
mu.MODELS["qwen2_gqa_lm"] = lambda n=4: transformers.Qwen2ForCausalLM(
    tiny_config(transformers.Qwen2Config, num_hidden_layers=n))


class Qwen3WithoutNormSum(Policy):
    """A deliberately wrong policy: Llama's layout for Qwen3, forgetting that the per-head q/k norms see only this
    rank's heads (their gradients must be summed over tp)."""
    layers = "layers"
    entry = {"embed_tokens": INPUT}
    exit = ("norm",)
    tp_plan = {"embed_tokens": VocabEmbedding(), "layers.*.self_attn.q_proj": Colwise(),
               "layers.*.self_attn.k_proj": Colwise(), "layers.*.self_attn.v_proj": Colwise(),
               "layers.*.self_attn.o_proj": Rowwise(), "layers.*.mlp.gate_proj": Colwise(),
               "layers.*.mlp.up_proj": Colwise(), "layers.*.mlp.down_proj": Rowwise()}
    head_tp_plan = {"lm_head": VocabHead()}


def _four_ranks(kinds):
    for kind in kinds:
        mu.check_training(kind, steps=1, tp_size=2)  # dp 2
        mu.check_training(kind, steps=1, pp_size=2, num_microbatches=2)  # dp 2
        mu.check_training(kind, tp_size=2, pp_size=2, num_microbatches=2)
    mu.check_training("qwen2_gqa_lm", tp_size=4)
    build = mu.MODELS["qwen3_lm"]
    assert compare(build, 2, 2) == ("pass", "", compare(build, 2, 2).max_loss_error)
    for family in COMPARED:
        cls = getattr(transformers, f"{family}ForCausalLM")
        verdict = compare(lambda: cls(tiny_config(cls.config_class)), 2, 2)
        assert verdict.result == "pass", (family, verdict)
    verdict = compare(build, 2, 2, policy=Qwen3WithoutNormSum())
    assert verdict.result == "fail" and verdict.detail.startswith(
        "gradient of model.layers.0.self_attn.q_norm.weight differs"), verdict


@pytest.mark.parametrize("kinds", [KINDS])
def test_derived_policies_train_exactly(kinds):
    run_distributed(4, _four_ranks, kinds)


def test_checker_cli_names_the_wrong_gradient(capsys):
    """The checker spawns its own processes and names the first differing parameter."""
    assert check_main(["Qwen3ForCausalLM", "--tp", "2", "--pp", "1",
                       "--policy", "tests.test_plans:Qwen3WithoutNormSum"]) == 1
    assert "FAIL Qwen3ForCausalLM tp=2 pp=1: gradient of model.layers.0.self_attn.q_norm.weight" in \
        capsys.readouterr().out


def test_shardformer_check_is_the_checker_and_shardformer_stays_below_it():
    """`python -m shardformer.check` runs the checker (its usage, exit status 0); importing shardformer loads neither
    the checker nor booster_plugin (the layers above it)."""
    import subprocess
    import sys
    probe = ("import runpy, sys, shardformer, shardformer.policies, shardformer.sharder; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hp_check', 'booster_plugin'))); "
             "sys.argv[1:] = ['--help']; runpy.run_module('shardformer.check', run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("[]\n"), run
    assert "usage: python -m hp_check" in run.stdout and "--policy" in run.stdout, run


def test_checker_cli_tells_a_launch_failure_from_a_mismatch(capsys, monkeypatch):
    """A rank that crashed, hung or never started is exit status 4 and ERROR, not FAIL (1, a real mismatch)."""
    import hp_check.cli as cli
    from hp_check.launch import LaunchFailed

    def crashed(*args, **kwargs):
        raise LaunchFailed("rank 1 exited with -9 (no message)")
    monkeypatch.setattr(cli, "run_standalone", crashed)
    assert check_main(["Qwen3ForCausalLM", "--tp", "2", "--pp", "1"]) == 4
    out = capsys.readouterr().out
    assert "ERROR Qwen3ForCausalLM tp=2 pp=1: the check could not run (rank 1 exited with -9" in out, out
    monkeypatch.setattr(cli, "run_standalone", lambda *a, **k: [(0, "error", "RuntimeError: socket"), (1, "ok", None)])
    assert check_main(["Qwen3ForCausalLM", "--tp", "2", "--pp", "1"]) == 4
    assert "could not run (rank 0: RuntimeError: socket)" in capsys.readouterr().out


def test_checker_on_a_saved_classifier_directory(tmp_path, capfd):
    """A model directory: the class its config.json names (a sequence classifier, with labels of its kind), progress
    printed, ranks launched by torchrun's standalone rendezvous."""
    transformers.LlamaForSequenceClassification(tiny_config(transformers.LlamaConfig)).save_pretrained(tmp_path)
    assert check_main([str(tmp_path), "--tp", "2", "--pp", "1"]) == 0
    out = capfd.readouterr().out  # (the ranks' progress lines come from their processes)
    assert "[hp_check] sharded step" in out and f"PASS {tmp_path} tp=2 pp=1" in out, out


def test_checker_on_a_saved_vision_language_model_directory(tmp_path, capfd):
    """A saved tiny LLaVA: text with images (image_batches.py), the pixel values on the first stage only and split
    into microbatches with their samples; a ViT classifier's batch: images with a class each."""
    from hp_check.compare import batch
    from tests.test_inferred_plans import _vit
    from tests.test_multimodal import llava
    llava(2).save_pretrained(tmp_path)
    assert check_main([str(tmp_path), "--tp", "1", "--pp", "2"]) == 0
    assert f"PASS {tmp_path} tp=1 pp=2" in capfd.readouterr().out
    images = batch(4, 0, _vit(transformers.ViTForImageClassification, 1))
    assert images["pixel_values"].shape == (4, 3, 8, 8) and images["labels"].shape == (4,)


def test_refusals_name_module_and_style():
    """A plan that cannot be honoured exactly is refused before any collective, naming module and style; a known
    style we cannot apply only where the model is tensor-split (tp_size > 1: pp, dp and ep still train it)."""
    model = mu.MODELS["qwen3_lm"]()
    model._tp_plan = {**model._tp_plan, "model.layers.*.mlp": "all_reduce"}
    policy = get_autopolicy(model)
    policy.check_tp(model.config, 1)
    with pytest.raises(PlanRefused, match=r"cannot be tensor-parallel: tp plan of 'layers\.\*\.mlp' uses style "
                                          r"'all_reduce': an all-reduce after a module.* Use tp_size=1"):
        policy.check_tp(model.config, 2)
    model = mu.MODELS["qwen3_lm"]()
    model._tp_plan = {**model._tp_plan, "model.layers.*.mlp.up_proj": "diagonal"}  # the plan transformers built
    with pytest.raises(PlanRefused, match=r"'layers\.\*\.mlp\.up_proj' uses style 'diagonal'"):
        get_autopolicy(model)


def test_features_a_plan_cannot_honour_are_refused():
    """Gemma3n's activation sparsity (statistics over the features tp splits) under tp; a pipeline split that puts
    a layer and the one whose keys/values it reuses on different stages."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig, Gemma4UnifiedForCausalLM, Gemma4UnifiedTextConfig
    model = Gemma3nForCausalLM(tiny_config(Gemma3nTextConfig))
    with pytest.raises(PlanRefused, match=r"tensor-parallel with config\.activation_sparsity_pattern"):
        get_autopolicy(model).check_tp(model.config, 2)
    # 4 layers sliding/full in turn, the last one reuses the keys/values of layer 1 (the last full one before it)
    policy = get_autopolicy(Gemma4UnifiedForCausalLM(tiny_config(Gemma4UnifiedTextConfig, num_kv_shared_layers=1)))
    policy.check_split([1, 3])
    with pytest.raises(PlanRefused, match=r"layer 3 reuses the keys/values of layer 1 .* split \[2, 2\]"):
        policy.check_split([2, 2])
