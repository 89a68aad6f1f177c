# Two commands for a newcomer: `make example` (train a small GPT-2 with pipeline parallel) and `make test`.
PYTHON ?= python3
# one process per GPU where there are GPUs, else 2 CPU processes (the example picks tp/pp for the world size)
NPROC ?= $(shell n=$$(nvidia-smi -L 2>/dev/null | wc -l); [ "$$n" -gt 0 ] && echo $$n || echo 2)

.PHONY: install example test test-fast test-lowest bench

install:
	@# torch first, pinned: here that takes the CPU wheel on disk; a plain `torch` requirement may pull a
	@# multi-GB CUDA build. An existing torch (e.g. your CUDA build) is kept.
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test,examples]"

example: install
	$(PYTHON) -m torch.distributed.run --nproc_per_node=$(NPROC) examples/train_gpt2.py

test: install
	$(PYTHON) -m pytest tests -q

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
