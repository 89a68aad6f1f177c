# Two commands for a newcomer: `make example` (train a small GPT-2 with pipeline parallel) and `make test`.
PYTHON ?= python3
# one process per GPU where there are GPUs, else 2 CPU processes (the example picks tp/pp for the world size)
NPROC ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | wc -l); [ "$$n" -gt 0 ] && echo $$n || echo 2)

.PHONY: install example test test-fast test-lowest bench gpu-check

install:
	@# torch first, pinned: here that takes the CPU wheel on disk; a plain `torch` requirement may pull a
	@# multi-GB CUDA build. An existing torch (e.g. your CUDA build) is kept.
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test,examples]"

example: install
	$(PYTHON) -m torch.distributed.run --nproc_per_node=$(NPROC) examples/train_gpt2.py

test: install
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest tests -q --durations=20

# one test per feature (tests/fast_subset.txt, about 1-2 minutes on 2 cores)
FAST_SUBSET = sed -e 's/\#.*//' -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$$//' -e '/^$$/d' tests/fast_subset.txt | tr '\n' '\0'
test-fast:
	$(FAST_SUBSET) | OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR) xargs -0 $(PYTHON) -m pytest -q

# the fast subset on the lowest torch and transformers that setup.py declares, in a venv cached outside the
# repository (built once by .ci/venv-lowest.sh, rebuilt when a lower bound moves); this checkout via PYTHONPATH
test-lowest:
	@py=$$(.ci/venv-lowest.sh $(PYTHON)) && \
	$(FAST_SUBSET) | OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR) xargs -0 $$py -m pytest -q

# every benchmark, one after another (timings want an otherwise idle machine); tables -> benchmarks/results/*.json
bench: install
	OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --nproc_per_node=2 benchmarks/bench_pipeline.py
	OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --nproc_per_node=2 benchmarks/bench_stage_cost.py
	OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --nproc_per_node=2 benchmarks/bench_tp.py
	OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --nproc_per_node=2 benchmarks/bench_p2p.py
	OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --nproc_per_node=2 benchmarks/bench_dp.py
	$(PYTHON) benchmarks/bench_memory.py
	$(PYTHON) benchmarks/bench_comm.py
	$(PYTHON) benchmarks/bench_lazy_init.py

# GPU readiness, on a machine with one GPU and no package registry (torch, transformers, peft, pytest, tqdm already
# there; this package is not installed: it runs from the checkout, so no `install`): the tests with
# HP_TEST_DEVICE=cuda, then benchmarks/bench_gpu.py (ours vs plain torch, bf16; ours with compiled layers, Liger's
# norms, enable_all_optimization). At most 9 minutes (the two timeouts below: one device call is 10); logs, junit.xml and gpu.json
# land in GPU_CHECK_OUT. On a CPU it runs too, e.g.
#   make gpu-check GPU_CHECK_TESTS=tests/test_layers.py GPU_BENCH_ARGS=--tiny
# Liger-Kernel (pure Python over Triton, which CUDA torch ships): without a registry, bring its wheel
# (`pip download liger-kernel==0.8.5 --no-deps`) and pass LIGER_WHEEL=path; else the Liger row says it is skipped.
LIGER_WHEEL ?=
GPU_CHECK_OUT ?= benchmarks/results/gpu-check
GPU_CHECK_TESTS ?= tests
GPU_TEST_ARGS ?=
GPU_BENCH_ARGS ?=
GPU_TEST_TIMEOUT ?= 240
GPU_BENCH_TIMEOUT ?= 300

gpu-check:
	@if [ -n "$(LIGER_WHEEL)" ]; then $(PYTHON) -m pip install --no-deps --no-index $(LIGER_WHEEL); fi
	@mkdir -p $(GPU_CHECK_OUT) && rm -f $(GPU_CHECK_OUT)/tests.rc $(GPU_CHECK_OUT)/bench.rc $(GPU_CHECK_OUT)/junit.xml $(GPU_CHECK_OUT)/gpu.json
	@echo "== gpu-check 1/2: HP_TEST_DEVICE=cuda pytest $(GPU_CHECK_TESTS) (at most $(GPU_TEST_TIMEOUT) s)"
	@{ HP_TEST_DEVICE=cuda PYTHONPATH=$(CURDIR) PYTHONUNBUFFERED=1 timeout -k 15 $(GPU_TEST_TIMEOUT) \
	    $(PYTHON) -m pytest $(GPU_CHECK_TESTS) -q -p no:cacheprovider --junitxml=$(GPU_CHECK_OUT)/junit.xml \
	    $(GPU_TEST_ARGS); echo $$? > $(GPU_CHECK_OUT)/tests.rc; } 2>&1 | tee $(GPU_CHECK_OUT)/tests.log
	@echo "== gpu-check 2/2: benchmarks/bench_gpu.py $(GPU_BENCH_ARGS) (at most $(GPU_BENCH_TIMEOUT) s)"
	@{ PYTHONPATH=$(CURDIR) PYTHONUNBUFFERED=1 timeout -k 15 $(GPU_BENCH_TIMEOUT) \
	    $(PYTHON) benchmarks/bench_gpu.py --out $(GPU_CHECK_OUT)/gpu.json $(GPU_BENCH_ARGS); \
	    echo $$? > $(GPU_CHECK_OUT)/bench.rc; } 2>&1 | tee $(GPU_CHECK_OUT)/bench.log
	@$(PYTHON) benchmarks/gpu_check_summary.py $(GPU_CHECK_OUT)
