"""Encoder-decoder models (T5: tied `shared` embedding, relative position bias split by heads) train exactly like
the unsharded model under tp × dp, generate the same greedy tokens with tp=2, and save HF checkpoints that plain
`from_pretrained` loads."""
import copy

import pytest
import torch
import torch.distributed as dist
from transformers import T5Config, T5ForConditionalGeneration

from booster_plugin import Booster, HybridParallelPlugin
from tests import model_utils as mu
from tests.dist_utils import run_distributed


def t5_config(layers: int = 2) -> T5Config:
    return T5Config(vocab_size=mu.VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_decoder_layers=layers,
                    num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0,
                    eos_token_id=2, decoder_start_token_id=0)


mu.MODELS["t5_lm"] = lambda n=2: T5ForConditionalGeneration(t5_config(n))
mu.MODELS["t5_gated_lm"] = lambda n=2: T5ForConditionalGeneration(
    T5Config(**{**t5_config(n).to_dict(), "feed_forward_proj": "gated-gelu"}))


def _generation_and_checkpoint(path: str) -> None:
    plugin = HybridParallelPlugin(tp_size=2)
    booster = Booster(plugin=plugin)
    reference = mu.build("t5_lm", 2).eval()
    model, *_ = booster.boost(copy.deepcopy(reference))
    model.eval()
    batch = mu.make_batch("t5_lm", 2, seed=3)
    with torch.no_grad():
        expected = reference.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=6,
                                      do_sample=False)
        actual = model.unwrap().generate(batch["input_ids"], attention_mask=batch["attention_mask"],
                                         max_new_tokens=6, do_sample=False)
    assert torch.equal(actual, expected), (actual, expected)
    booster.save_model(model, path)
    dist.barrier()
    loaded = T5ForConditionalGeneration.from_pretrained(path)
    for name, p in reference.state_dict().items():
        mu.assert_close(loaded.state_dict()[name], p, f"checkpoint {name}")


def _four_ranks(path: str) -> None:
    mu.check_training("t5_lm", tp_size=2)  # dp=2
    mu.check_training("t5_gated_lm", tp_size=2, layers=2)
    _generation_and_checkpoint(path)


def test_t5_tensor_parallel(tmp_path):
    run_distributed(4, _four_ranks, str(tmp_path / "t5"))


def test_t5_pipeline_is_refused():
    from shardformer.policies.t5 import T5Policy
    with pytest.raises(NotImplementedError, match="pp_size=1"):
        T5Policy().set_pipeline_stage_manager(object())
