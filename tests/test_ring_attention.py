"""Ring attention (shardformer/layer/ring_attention.py) on zigzag shards equals single-process attention on the full
sequence with the document-causal mask: outputs and dQ/dK/dV, fp32 at 1e-5, on 2 ranks (and 4 for one case); a
tiny Llama whose layers run on zigzag-sharded hidden states with the ring adapter equals the unsharded model."""
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardformer.layer import ring_attention
from shardformer.layer.ring_attention import RingAttention
from shardformer.layer.ring_layout import (BlockKind, BlockMasks, document_ids, documents, gather_zigzag,
                                           shard_position_ids, shard_zigzag, unshard_zigzag, zigzag_index)
from tests.dist_utils import run_distributed

S = 48  # 2 ranks: 4 chunks of 12; 4 ranks: 8 chunks of 6
TOL = dict(rtol=1e-5, atol=1e-5)


def _packed(lengths_per_row):
    """position_ids [b, S] restarting at 0 at every document start."""
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row])


PLAIN = torch.arange(S).expand(2, S)
PACKED = _packed([[17, 5, 26], [30, 18]])  # boundaries inside chunks (12, 24, 36) and one document per chunk edge


def _reference_mask(position_ids, window=None):
    """True = may attend: same document (transformers' own packed-sequence detection), causal, within the window."""
    from transformers.masking_utils import find_packed_sequence_indices
    docs = find_packed_sequence_indices(position_ids)
    docs = torch.zeros_like(position_ids) if docs is None else docs
    q, k = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (k <= q) & ((k > q - window) if window is not None else True)
    return (allowed[None] & (docs[:, :, None] == docs[:, None, :]))[:, None]


def _reference(q, k, v, mask, sinks=None):
    """Full-sequence attention [b, h, S, d] -> [b, S, h, d]: torch sdpa, or the GPT-OSS formula with sinks."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
    return (logits.softmax(-1)[..., :-1] @ v).transpose(1, 2)


def _check_kernel(position_ids, heads=4, kv_heads=4, window=None, sinks=False, packed=True, tile_rows=None):
    """Every rank builds the same full inputs; ring attention on its zigzag shards must give the reference's output
    and gradients (gathered and unsharded). `tile_rows`: cut each block into row tiles of that many queries."""
    if tile_rows is not None:
        budget = ring_attention._TILE_BYTES
        ring_attention._TILE_BYTES = {**budget, "cpu": tile_rows * 4 * 2 * kv_heads * S // (2 * dist.get_world_size())}
        try:
            return _check_kernel(position_ids, heads, kv_heads, window, sinks, packed)
        finally:
            ring_attention._TILE_BYTES = budget
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, S, 8, generator=g) for h in (heads, kv_heads, kv_heads))
    sink = torch.randn(heads, generator=g) if sinks else None
    weight = torch.randn(2, S, heads, 8, generator=g)
    for t in (q, k, v) + ((sink,) if sinks else ()):
        t.requires_grad_()
    expected = _reference(q, k, v, _reference_mask(position_ids if packed else PLAIN, window), sink)
    (expected * weight).sum().backward()
    local = [shard_zigzag(t.detach(), world, rank, dim=2).requires_grad_() for t in (q, k, v)]
    local_sink = sink.detach().clone().requires_grad_() if sinks else None
    module = SimpleNamespace(is_causal=True)
    extra = {"s_aux": local_sink} if sinks else {}
    ring = RingAttention(dist.group.WORLD, position_ids, packed=packed)
    out, _ = ring(module, *local, None, sliding_window=window, **extra)
    (out * shard_zigzag(weight, world, rank, dim=1)).sum().backward()
    torch.testing.assert_close(gather_zigzag(out.detach(), None, dim=1), expected.detach(), **TOL)
    for mine, full in zip(local, (q, k, v)):
        torch.testing.assert_close(gather_zigzag(mine.grad, None, dim=2), full.grad, **TOL)
    if sinks:
        dist.all_reduce(local_sink.grad)  # each rank holds its queries' part of a replicated parameter's gradient
        torch.testing.assert_close(local_sink.grad, sink.grad, **TOL)


def _check_llama():
    """A tiny LlamaForCausalLM with the ring adapter as its attention: embeddings and rotary tables on the full
    packed row, layers on the zigzag shard (sharded position ids: the adapter all-gathers them), norm and head on
    the shard; logits and the summed parameter gradients equal the unsharded sdpa model's."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    world, rank = dist.get_world_size(), dist.get_rank()
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config)
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(1))
    weight = torch.randn(2, S, 64, generator=torch.Generator().manual_seed(2))
    logits = reference(input_ids=ids, position_ids=PACKED, use_cache=False).logits  # a cache turns packing off
    (logits * weight).sum().backward()
    AttentionInterface.register("ring_test", RingAttention(dist.group.WORLD))
    model.config._attn_implementation = "ring_test"
    base = model.model
    hidden = base.embed_tokens(ids)
    tables = tuple(shard_zigzag(t, world, rank) for t in base.rotary_emb(hidden, PACKED))
    hidden, positions = shard_zigzag(hidden, world, rank), shard_position_ids(PACKED, world, rank)
    for layer in base.layers:
        hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=tables)
    local_logits = model.lm_head(base.norm(hidden))
    (local_logits * shard_zigzag(weight, world, rank)).sum().backward()
    torch.testing.assert_close(gather_zigzag(local_logits.detach(), None), logits.detach(), **TOL)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, ref.grad, **TOL, msg=lambda m: f"{name}: {m}")


def _check_refusals():
    """Refused before any collective, on every rank alike."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ring, module = RingAttention(dist.group.WORLD), SimpleNamespace(is_causal=True)
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="even local length"):
        ring(module, q, q, q, None)
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_zigzag(torch.zeros(1, 6), world, rank)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="dropout"):
        ring(module, q, q, q, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="bidirectional"):
        ring(SimpleNamespace(is_causal=False), q, q, q, None)
    with pytest.raises(ValueError, match="neither the full"):
        ring(module, q, q, q, None, position_ids=torch.arange(5))


def _two_ranks():
    _check_refusals()
    _check_kernel(PLAIN)
    _check_kernel(PACKED)
    _check_kernel(PLAIN, window=7)
    _check_kernel(PACKED, window=20)
    _check_kernel(PACKED, kv_heads=2)
    _check_kernel(PACKED, kv_heads=2, window=9, sinks=True, tile_rows=5)  # tiles of 5, 5, 2 rows per query head
    _check_kernel(PACKED, packed=False)  # document boundaries ignored: one causal row
    _check_llama()


def _four_ranks():
    _check_kernel(PACKED, kv_heads=2, window=13)
    _check_llama()


def test_ring_attention_two_ranks():
    run_distributed(2, _two_ranks)


def test_ring_attention_four_ranks():
    run_distributed(4, _four_ranks)


def test_zigzag_layout_round_trip_and_balance():
    x = torch.arange(2 * S).view(2, S)
    parts = [shard_zigzag(x, 3, r) for r in range(3)]
    assert parts[0][0, :8].tolist() == list(range(8)) and parts[0][0, 8:].tolist() == list(range(40, 48))
    assert torch.equal(unshard_zigzag(parts), x)
    order = zigzag_index(S, 3)  # contiguous split of the reordered sequence = the zigzag parts
    assert torch.equal(x[:, order], torch.cat(parts, 1)) and torch.equal(x[:, order][:, order.argsort()], x)
    masks = BlockMasks(chunk=8)  # causal, sp=3: every rank computes the same number of blocks (2 diagonal)
    work = [sum(masks.kind(qc, kc) is not BlockKind.SKIP for qc in (r, 5 - r) for kc in range(6)) for r in range(3)]
    assert work == [7, 7, 7]


def test_documents_and_block_skips():
    assert document_ids(PACKED)[0, [0, 16, 17, 21, 22, 47]].tolist() == [0, 0, 1, 1, 2, 2]
    assert documents(PLAIN, 2) is None
    masks = BlockMasks(chunk=12, docs=documents(_packed([[24, 24]] * 2), 2))
    assert masks.kind(2, 0) is BlockKind.SKIP and masks.kind(1, 0) is BlockKind.FULL
    assert masks.kind(3, 2) is BlockKind.FULL and masks.kind(3, 3) is BlockKind.MASKED
    window = BlockMasks(chunk=12, window=5)
    assert window.kind(1, 0) is BlockKind.MASKED and window.kind(2, 0) is BlockKind.SKIP
