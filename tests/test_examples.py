"""The README's main example runs under torchrun (a short run), saves a checkpoint that plain transformers loads,
and the plugin explains how to launch when torch.distributed has no environment."""
import os
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


def test_plugin_without_distributed_environment_says_how_to_launch(monkeypatch):
    import torch.distributed as dist
    from booster_plugin.plugin import ensure_distributed

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node=N"):
        ensure_distributed()
