"""Encoder-decoder models (T5: tied `shared` embedding, relative position bias split by heads) train exactly like
the unsharded model under tp × dp, generate the same greedy tokens with tp=2, and save HF checkpoints that plain
`from_pretrained` loads.
(`four_ranks` runs in tests/test_seeds.py, one process group for all three files.)"""
import copy

import torch
import torch.distributed as dist
from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

from booster_plugin import Booster, HybridParallelPlugin
from tests import model_utils as mu
from tests.readme_blocks import readme_block


def t5_config(layers: int = 2) -> T5Config:
    return T5Config(vocab_size=mu.VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_decoder_layers=layers,
                    num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0,
                    eos_token_id=2, decoder_start_token_id=0)


def bart_config(layers: int = 2) -> BartConfig:
    return BartConfig(vocab_size=mu.VOCAB, d_model=32, encoder_layers=layers, decoder_layers=layers,
                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                      max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)


mu.MODELS["bart_lm"] = lambda n=2: BartForConditionalGeneration(bart_config(n))
mu.MODELS["t5_lm"] = lambda n=2: T5ForConditionalGeneration(t5_config(n))
mu.MODELS["t5_gated_lm"] = lambda n=2: T5ForConditionalGeneration(
    T5Config(**{**t5_config(n).to_dict(), "feed_forward_proj": "gated-gelu"}))


def _generate(kind: str) -> None:
    """Greedy generation with tp=2 (dp=2) gives the unsharded model's tokens."""
    reference = mu.build(kind, 2).eval()
    model, *_ = Booster(plugin=HybridParallelPlugin(tp_size=2)).boost(copy.deepcopy(reference))
    model.eval()
    batch = mu.make_batch(kind, 2, seed=3)
    with torch.no_grad():
        expected, actual = (m.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=6,
                                       do_sample=False) for m in (reference, model.unwrap()))
    assert torch.equal(actual, expected), (kind, actual, expected)


def _checkpoint(kind: str, path: str, **layout) -> None:
    """A model saved from a (tp, pp) layout is a Hugging Face checkpoint that plain from_pretrained loads."""
    reference = mu.build(kind, 3)
    booster = Booster(plugin=HybridParallelPlugin(**layout))
    model, *_ = booster.boost(copy.deepcopy(reference))
    booster.save_model(model, path, shard=True, size_per_shard=1)
    dist.barrier()
    loaded = type(reference).from_pretrained(path).state_dict()
    for name, p in reference.state_dict().items():
        mu.assert_close(loaded[name], p, f"{kind} checkpoint {name}")
    dist.barrier()


def _readme_example() -> None:
    """The README's T5 example (tp=2 × pp=2, 3 + 3 layers split [2, 4]): one step equals the unsharded model."""
    reference = mu.build("t5_lm", 3)
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    batch = mu.make_batch("t5_lm", 8, seed=5)
    namespace = {"Booster": Booster, "HybridParallelPlugin": HybridParallelPlugin, "model": model, "batch": batch,
                 "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)}
    exec(readme_block("### Encoder-decoder models"), namespace)
    plugin = namespace["plugin"]
    loss = mu.microbatch_mean_loss(reference, batch, 4)
    loss.backward()
    ref_opt.step()
    mu.assert_close(namespace["out"]["loss"], loss.detach(), "README T5 loss")
    ref = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in namespace["model"].unwrap().named_parameters():
        mu.assert_close(mu.gathered(p, p.data, plugin.tp_group), ref[name].data, f"README T5 param {name}")


def four_ranks(path: str) -> None:
    _readme_example()
    mu.check_training("t5_lm", tp_size=2, layers=2)  # dp=2
    mu.check_training("t5_gated_lm", tp_size=2, layers=2)
    mu.check_training("bart_lm", tp_size=2, layers=2)
    for kind in ("t5_lm", "bart_lm"):
        _generate(kind)
        # 2 + 2 layers on 2 stages: the encoder on one, the decoder on the other (dp=2)
        mu.check_training(kind, layers=2, pp_size=2, num_microbatches=2)
        # 3 + 3 layers on 4 stages: [2, 2, 1, 1]: stage 1 holds the last encoder and first decoder layer
        mu.check_training(kind, layers=3, pp_size=4, num_microbatches=4, num_layers_per_stage=[2, 2, 1, 1])
        if kind == "bart_lm":
            mu.check_training(kind, layers=3, pp_size=4, num_microbatches=4)  # [1, 2, 2, 1]
        if kind != "t5_lm":  # T5 runs this layout in the README example
            mu.check_training(kind, layers=3, tp_size=2, pp_size=2, num_microbatches=2, num_layers_per_stage=[2, 4])
        _checkpoint(kind, f"{path}/{kind}", tp_size=2, pp_size=2, num_microbatches=2)


class _Stage1Of2:
    """Stage 1 of 2 (a stage manager without processes), for a look inside one stage."""
    num_stages, stage, num_layers_per_stage = 2, 1, [1, 3]

    def layers_per_virtual_stage(self, num_layers, costs=None):
        return self.num_layers_per_stage

    def get_stage_index(self, layers_per_stage):
        return layers_per_stage[0], sum(layers_per_stage)

    def is_first_stage(self):
        return False

    def is_last_stage(self):
        return True


def test_t5_stage_starting_inside_the_encoder_does_not_drop_its_input_out_again():
    """T5Stack calls one dropout module before its blocks and after its final norm: on a stage that starts inside
    the stack the first call is skipped (the previous stage applied it), the second still runs."""
    from shardformer.policies.t5 import T5Policy

    model = T5ForConditionalGeneration(T5Config(**{**t5_config().to_dict(), "dropout_rate": 0.5})).train()
    policy = T5Policy()
    policy.set_model(model)
    policy.set_pipeline_stage_manager(_Stage1Of2())
    stage = policy.release_unheld_layers()
    seen, exit_calls = [], []
    model.encoder.block[1].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    model.encoder.dropout.module.register_forward_hook(lambda m, args, out: exit_calls.append(out))
    hidden = torch.randn(2, mu.SEQ, 32)
    batch = mu.make_batch("t5_lm", 2, seed=1)
    out = stage(hidden_states=hidden, **batch)
    assert torch.equal(seen[0], hidden) and len(exit_calls) == 1 and out.loss is not None
    stage(hidden_states=hidden, **batch)  # every forward skips its first call again
    assert torch.equal(seen[1], hidden) and len(exit_calls) == 2
