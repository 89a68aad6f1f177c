"""Sequence parallelism: the modes and their checks (parallel.py), the loss on a split sequence (loss.py), Ulysses'
head exchange (ulysses.py) and ring attention (ring.py over ring_attention.py, ring_layout.py, ring_blocks.py,
ring_kernels.py). The ranks a sequence is split over are decided by the parallel context (`ctx.seq`)."""
