"""The README's main example runs under torchrun (a short run), saves a checkpoint that plain transformers loads,
and the plugin explains how to launch when torch.distributed has no environment."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import _free_port

ROOT = Path(__file__).resolve().parents[1]


# launches a script in a world group without a CPU backend, as `init_process_group("nccl")` makes on GPUs
NCCL_SHAPED = str(ROOT / "tests" / "nccl_shaped.py")


def test_train_gpt2_example_runs_with_pipeline_parallel(tmp_path):
    """In the world group a GPU script creates ("nccl": no CPU backend; "cuda:gloo" here)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           NCCL_SHAPED, str(ROOT / "examples" / "train_gpt2.py"), "--steps", "6", "--batch-size", "8", "--seq-len", "64",
           "--out", str(tmp_path / "gpt2")]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "validation loss after" in run.stdout, run.stdout[-3000:]
    assert (tmp_path / "gpt2" / "config.json").exists()
    assert list((tmp_path / "gpt2").glob("*.safetensors"))



def test_trainer_sft_example_runs(tmp_path):
    """examples/trainer_sft.py: TRL's SFTTrainer (HybridParallelSFTTrainer) at pp=2, evaluate, save_model, plain
    transformers reloads."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           str(ROOT / "examples" / "trainer_sft.py"), "--steps", "4", "--out", str(tmp_path / "sft")]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "validation loss after" in run.stdout and "generated from" in run.stdout, run.stdout[-3000:]
    assert (tmp_path / "sft" / "final" / "config.json").exists()

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
    from booster_plugin.guards.launch import ensure_distributed

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node=N"):
        ensure_distributed()


def _reference_losses(steps: int, batch_size: int = 4):
    """One process on examples/resume_training.py's model and data: the losses every layout must give."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    from resume_training import batch_of_step, model_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.1 * step))
    losses = []
    for step in range(steps):
        loss = model(**batch_of_step(step, batch_size)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def _printed_losses(stdout: str):
    return {int(s): float(v) for s, v in re.findall(r"step (\d+) loss (\d+\.\d+)", stdout)}


def test_kill_one_rank_then_resume_is_exact(tmp_path):
    """A 4-rank torchrun job (tp=2 x pp=2) loses rank 3 at step 3: the other ranks stop, torchrun restarts the job
    (--max-restarts=1), every rank resumes from the newest complete checkpoint (step 2), and the losses of all steps,
    before and after the kill, equal one process's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--max-restarts=1",
           f"--master_port={_free_port()}", str(ROOT / "examples" / "resume_training.py"),
           "--ckpt-dir", str(tmp_path / "ckpt"), "--steps", "5", "--kill-rank", "3", "--kill-at-step", "3",
           "--timeout", "60"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "attempt 0: starting at step 0" in run.stdout and "attempt 1: starting at step 3" in run.stdout, run.stdout
    losses = _printed_losses(run.stdout)
    assert sorted(losses) == [0, 1, 2, 3, 4], run.stdout
    for step, expected in enumerate(_reference_losses(5)):
        assert abs(losses[step] - expected) < 1e-5, (step, losses[step], expected)


def test_two_nodes_train_like_one(tmp_path):
    """Two torchrun "nodes" on this machine (static rendezvous on 127.0.0.1, 2 ranks each) train tp=2 x pp=2 with
    one process's losses, in a world group without a CPU backend (as "nccl")."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    port = _free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                               "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}",
                               NCCL_SHAPED, str(ROOT / "examples" / "resume_training.py"), "--ckpt-dir", str(tmp_path / "ckpt"),
                               "--steps", "3", "--save-every", "100"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in range(2)]
    outs = [node.communicate(timeout=400) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), [o[1][-2000:] for o in outs]
    losses = _printed_losses(outs[0][0])  # global rank 0 is on node 0
    assert sorted(losses) == [0, 1, 2], outs[0][0]
    for step, expected in enumerate(_reference_losses(3)):
        assert abs(losses[step] - expected) < 1e-5, (step, losses[step], expected)
