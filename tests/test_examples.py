"""The README's main example runs under torchrun (a short run), saves a checkpoint that plain transformers loads,
and the plugin explains how to launch when torch.distributed has no environment."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_train_gpt2_example_runs_with_pipeline_parallel(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    from tests.dist_utils import _free_port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           str(ROOT / "examples" / "train_gpt2.py"), "--steps", "6", "--batch-size", "8", "--seq-len", "64",
           "--out", str(tmp_path / "gpt2")]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "validation loss after" in run.stdout, run.stdout[-3000:]
    assert (tmp_path / "gpt2" / "config.json").exists()
    assert list((tmp_path / "gpt2").glob("*.safetensors"))


SCRIPT = """
import torch, torch.distributed as dist
from booster_plugin import Booster, HybridParallelPlugin
from tests import model_utils as mu
torch.set_num_threads(1)
assert not dist.is_initialized()
plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2)  # initializes from torchrun's environment
assert dist.is_initialized() and "gloo" in str(dist.get_backend()), dist.get_backend()
booster = Booster(plugin=plugin)
model = mu.build("gpt2_lm")
model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters()))
loss = booster.execute_pipeline(iter([mu.make_batch("gpt2_lm", 4, 0)]), model, mu.criterion, opt)["loss"]
print(f"rank {dist.get_rank()} loss {loss.item():.6f}")
"""


def test_plugin_initializes_distributed_from_torchrun(tmp_path):
    from tests.dist_utils import _free_port
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={_free_port()}", str(script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = dict(re.findall(r"rank (\d) loss (\d+\.\d{6})", run.stdout))  # the two ranks' lines may interleave
    assert set(found) == {"0", "1"} and found["0"] == found["1"], run.stdout  # the loss is on every stage


def test_plugin_without_distributed_environment_says_how_to_launch(monkeypatch):
    import torch.distributed as dist
    from booster_plugin.plugin import ensure_distributed

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node=N"):
        ensure_distributed()
