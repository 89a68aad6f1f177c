"""Regional compilation (`compile_layers=True`): each decoder layer compiled with torch.compile trains equal to the
unsharded eager model (loss, gradients, parameters after AdamW, fp32 at 1e-5) under tensor parallelism (2 ranks:
its collectives are graph breaks), and the layers really ran compiled."""
import torch

from tests import model_utils as mu
from tests.dist_utils import run_distributed


def _cases() -> None:
    torch._dynamo.utils.counters.clear()
    mu.check_training("llama_lm", layers=2, tp_size=2, compile_layers=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "no layer ran compiled"


def test_compiled_layers_equal_one_process():
    run_distributed(2, _cases)
