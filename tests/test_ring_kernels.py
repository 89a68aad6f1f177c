"""Ring attention's fused block kernels (torch's attention kernels with log-sum-exp: CPU's flash kernel, CUDA's
memory-efficient one) equal the hand-written blocks on local blocks: output, log-sum-exp and the gradients of
queries, keys and values, for full, causal and masked blocks (documents; a sliding window, whose blocks have rows
without any key), grouped key/value heads, fp32 and bf16, a chunk length that is no multiple of the kernels'
alignment. On CPU in CI; on the GPU under HP_TEST_DEVICE=cuda (`make gpu-check`)."""
from __future__ import annotations

import pytest
import torch

from shardformer.sequence import ring_blocks
from shardformer.sequence.ring_blocks import Block, block_backward, block_forward, finite
from shardformer.sequence.ring_layout import BlockKind, BlockMasks, documents
from tests.dist_utils import TEST_DEVICE

pytestmark = pytest.mark.cuda

DEVICE = torch.device("cuda" if TEST_DEVICE == "cuda" else "cpu")
C = 12  # chunk length
DOCS = documents(torch.cat([torch.arange(17), torch.arange(31)]).expand(2, 48), 2)  # an edge in chunk 1 of 4
BLOCKS = {  # name: (masks, query chunk, key chunk, expected kind)
    "full": (BlockMasks(chunk=C), 2, 0, BlockKind.FULL),
    "causal": (BlockMasks(chunk=C), 1, 1, BlockKind.CAUSAL),
    "documents": (BlockMasks(chunk=C, docs=DOCS), 1, 1, BlockKind.MASKED),
    "window": (BlockMasks(chunk=C, window=5), 1, 0, BlockKind.MASKED),  # rows 17-23 have no key in chunk 0
}
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _run(block: Block, q, k, v, grad, fused: bool):
    """Forward, then the backward of this block as the whole attention (its own output and log-sum-exp final)."""
    saved = ring_blocks.FUSED
    ring_blocks.FUSED = saved if fused else {}
    try:
        out, lse = block_forward(q, k, v, block)
        final_out = out.to(q.dtype)
        delta = (grad.float() * final_out.float()).sum(-1)
        grads = block_backward(q, k, v, grad, final_out, finite(lse), delta, block)
    finally:
        ring_blocks.FUSED = saved
    return out.float(), lse, [g.float() for g in grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_fused_block_equals_hand_written(name, kv_heads, dtype):
    assert DEVICE.type in ring_blocks.FUSED, f"no fused ring kernels for {DEVICE.type}"
    masks, qc, kc, kind = BLOCKS[name]
    assert masks.kind(qc, kc) is kind
    block = Block(kind, masks, qc, kc)
    g = torch.Generator().manual_seed(0)
    batch = 1 if masks.docs is None else 2
    q, k, v, grad = (torch.randn(batch, heads, C, 16, generator=g).to(DEVICE, dtype)
                     for heads in (4, kv_heads, kv_heads, 4))
    q = q * 0.25
    fused, hand = _run(block, q, k, v, grad, True), _run(block, q, k, v, grad, False)
    tol = TOL[dtype]
    torch.testing.assert_close(fused[1], hand[1], rtol=tol, atol=tol, msg=lambda m: f"log-sum-exp: {m}")
    if name == "window":
        assert torch.isneginf(hand[1]).any(), "the window block has rows without any key"
    for what, a, b in (("output", fused[0], hand[0]), *zip(("dq", "dk", "dv"), fused[2], hand[2])):
        scale = max(1.0, b.abs().max().item())  # bf16: both round to 8 bits, relative to the largest value
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale, msg=lambda m: f"{name} {what}: {m}")
