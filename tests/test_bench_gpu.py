"""Smoke test of benchmarks/bench_gpu.py (--tiny: tiny models at seq 64, every row, a few steps) and of
`make gpu-check`'s summary over its results. On the CPU unless HP_TEST_DEVICE=cuda."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_gpu_tiny_every_row(tmp_path):
    device = "cuda" if os.environ.get("HP_TEST_DEVICE") == "cuda" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("HP_TEST_DEVICE=cuda, but torch sees no CUDA device")
    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--tiny", "--warmup", "2",
                          "--steps", "1", "--models", "llama", "--device", device, "--out", str(out),
                          # (the compiled rows compile for tens of seconds on a CPU: tests/test_regional_compile.py
                          # covers compilation)
                          "--sides", "ours,ours_mb2,plain,plain_ga2,bf16,ours_liger"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["failed"] == []
    for name in ("llama",):  # (the MoE shape runs the same rows; the GPU run covers it)
        entry = results["models"][name]
        assert entry["same_init"], entry
        sides = entry["sides"]
        assert len(sides) == 6
        liger = sides.pop("ours liger")
        if device == "cpu":  # Liger is Triton, CUDA only: the row says so instead of a number
            assert liger == {"skipped": "Liger-Kernel's kernels are Triton kernels for CUDA GPUs; this run is on cpu"}
        for side, row in sides.items():
            assert len(row["losses"]) == 3 and len(row["step_ms"]) == 1, (name, side)
            assert row["fused"] == results["fused_adamw"] and row["training"], (name, side)
        assert sides["ours bf16"]["stepped_dtype"] == "torch.float32"  # fp32 master weights
        # same weights and data: the first losses agree (ours runs the pure-bf16 forward; autocast rounds elsewhere)
        first = {side: row["losses"][0] for side, row in sides.items()}
        assert abs(first["ours bf16"] - first["pure bf16"]) < 1e-3, first
        assert max(first.values()) - min(first.values()) < 2e-2, first
        assert set(entry["ratio_ours_over_plain"]) == {"ours bf16 / plain autocast",
                                                       "ours bf16 mb=2 / plain autocast ga=2"}
    assert "ours bf16 mb=2" in results["table"]

    # the summary `make gpu-check` prints, over the bench's results and a junit file
    (tmp_path / "junit.xml").write_text('<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="2" '
                                        'tests="10" time="1.5"></testsuite></testsuites>')
    (tmp_path / "tests.rc").write_text("1\n")
    (tmp_path / "bench.rc").write_text("0\n")
    summary = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check_summary.py"),
                              str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert summary.returncode == 1, summary.stdout + summary.stderr
    assert "tests: 7 passed, 1 failed, 0 errors, 2 skipped of 10" in summary.stdout
    assert "ours bf16 mb=2" in summary.stdout and "gpu-check: FAILED (tests)" in summary.stdout
