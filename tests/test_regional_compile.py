"""Regional compilation (`compile_layers=True`): each decoder layer compiled with torch.compile trains equal to the
unsharded eager model (loss, gradients, parameters after AdamW, fp32 at 1e-5) under tp=2 x pp=2 (also with every
layer activation-checkpointed), ring sequence parallelism (sp=2) and expert parallelism (ep=2), in one launch of 4
ranks; the layers really ran compiled, and the graph breaks are only the documented ones: none under tensor
parallelism (its collectives are traced, as torch's functional collectives; a checkpoint is traced into the layer's
graph), the exit hook after a non-last pipeline stage's last layer, the ring attention call under ring sp, the
expert exchange hooks and transformers' own router-logit capture under ep."""
from collections import Counter

import pytest
import torch

from booster_plugin.core.activation_checkpoint import GradientCheckpointConfig
from tests import model_utils as mu
from tests import test_expert_parallel  # noqa: F401 (registers qwen3moe_lm)
from tests.dist_utils import run_distributed

CKPT = GradientCheckpointConfig(gradient_checkpointing_ratio=1.0)
SP_RING = dict(sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="ring_attn")
# the only graph-break sites each layout may have (substrings of dynamo's reasons)
ALLOWED = {"tp2 pp2": ("StageForward._exit_hook",), "ring sp2": ("RingAttention.__call__",),
           "ep2": ("_Exchange.dispatch", "_Exchange.combine", "ContextVar")}


def _compiled(name: str, kind: str, **plugin_kwargs) -> Counter:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mu.check_training(kind, layers=2, steps=1, compile_layers=True, **plugin_kwargs)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] > 0, f"{name}: no layer ran compiled"
    unexpected = [reason for reason in counters["graph_break"] if not any(a in reason for a in ALLOWED[name])]
    assert not unexpected, f"{name}: unexpected graph breaks {unexpected}"
    return counters["graph_break"]


def _cases() -> None:
    _compiled("tp2 pp2", "llama_lm", tp_size=2, pp_size=2, num_microbatches=2)
    # checkpointed layers: the checkpoint traced into each layer's graph, the tp regions' slots set inside it (without
    # regional_compile.tracing_checkpoints() each layer breaks at its checkpoint: "HOP: Unsafe side effect")
    _compiled("tp2 pp2", "llama_lm", tp_size=2, pp_size=2, num_microbatches=2, gradient_checkpoint_config=CKPT)
    assert _compiled("ring sp2", "llama_lm", **SP_RING), "the ring attention ran compiled?"
    _compiled("ep2", "qwen3moe_lm", ep_size=2)


def test_compiled_layers_equal_one_process():
    run_distributed(4, _cases)


def _checkpointed() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mu.check_training("llama_lm", layers=2, steps=1, compile_layers=True, gradient_checkpoint_config=CKPT)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.cuda  # (also on the GPU: `make gpu-check`)
def test_compiled_checkpointed_layers_world_of_one():
    """Activation checkpointing inside a compiled layer (world of one): traced into the graph, no break, exact."""
    run_distributed(1, _checkpointed)
