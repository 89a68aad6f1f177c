"""Ring attention (shardformer/sequence/ring_attention.py) on zigzag shards equals single-process attention on the full
sequence: outputs and dQ/dK/dV, fp32 at 1e-5, on 2 ranks (and 4 for some cases), with the document-causal mask of
position ids and with a given full mask (bool, or additive with rows without any key). Whole models (Llama, Qwen2 with
full and sliding layers; sdpa and eager) whose forward builds its own mask on the full sequence while hooks run the
decoder layers on zigzag shards through the ring adapter (what the plugin's integration does) equal the one-process
model: logits and parameter gradients, for packed rows with and without a cache, right and left padding."""
import collections
import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardformer.sequence import ring_blocks
from shardformer.sequence.ring_attention import RingAttention, register_ring_attention
from shardformer.sequence.ring_layout import (BlockKind, BlockMasks, analyse_mask, document_ids, documents,
                                           gather_zigzag, model_mask, shard_position_ids, shard_zigzag,
                                           unshard_zigzag, zigzag_index)
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


def _reference(q, k, v, mask, sinks=None, softcap=None):
    """Full-sequence attention [b, h, S, d] -> [b, S, h, d]: torch sdpa (bool or -inf mask: rows without any key
    give 0), eager's formula (an additive mask of the dtype's minimum: such rows are uniform over all keys; sdpa's
    CPU backward differs from eager there), or the GPT-OSS formula with sinks; `softcap`: Gemma 2's eager formula
    (scores soft-capped before the mask)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if softcap is not None:
        scores = torch.tanh(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 / softcap) * softcap
        scores = scores + mask if mask.is_floating_point() else scores.masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1).nan_to_num() @ v).transpose(1, 2)
    if mask.is_floating_point() and bool(mask.isfinite().all()):
        return ((q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + mask).softmax(-1) @ v).transpose(1, 2)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
    return (logits.softmax(-1)[..., :-1] @ v).transpose(1, 2)


@contextlib.contextmanager
def _blocks_by(tile_rows, kv_heads):
    """tile_rows None: torch's fused CPU kernels compute the blocks (counted: both must have run on some rank; blocks
    with uniform rows fall back); else the hand-written fallback (no fused kernels), in row tiles of `tile_rows`
    queries."""
    fused, budget = ring_blocks.FUSED, ring_blocks.TILE_BYTES
    calls = collections.Counter()
    if tile_rows is None:
        kernels = fused["cpu"]
        ring_blocks.FUSED = {"cpu": kernels._replace(
            forward=lambda *a: calls.update(["forward"]) or kernels.forward(*a),
            backward=lambda *a: calls.update(["backward"]) or kernels.backward(*a))}
    else:
        ring_blocks.FUSED = {}
        ring_blocks.TILE_BYTES = {**budget, "cpu": tile_rows * 4 * 2 * kv_heads * S // (2 * dist.get_world_size())}
    try:
        yield
    finally:
        ring_blocks.FUSED, ring_blocks.TILE_BYTES = fused, budget
    if tile_rows is None:
        ran = torch.tensor([calls["forward"], calls["backward"]])
        dist.all_reduce(ran)
        assert bool((ran > 0).all()), calls


def _check_kernel(position_ids, heads=4, kv_heads=4, window=None, sinks=False, documents="position_ids",
                  tile_rows=None, mask=None, softcap=None):
    """Every rank builds the same full inputs; ring attention on its zigzag shards must give the reference's output
    and gradients (gathered and unsharded). Blocks by torch's fused kernels, or with `tile_rows` by the hand-written
    fallback in row tiles of that many queries (soft-capped blocks always run there). `mask`: a full mask given to
    the adapter (documents="mask"), instead of the documents of `position_ids`."""
    with _blocks_by(tile_rows, kv_heads):
        _compare_kernel(position_ids, heads, kv_heads, window, sinks, documents, mask, softcap)


def _compare_kernel(position_ids, heads, kv_heads, window, sinks, documents, mask, softcap=None):
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, S, 8, generator=g) for h in (heads, kv_heads, kv_heads))
    sink = torch.randn(heads, generator=g) if sinks else None
    weight = torch.randn(2, S, heads, 8, generator=g)
    for t in (q, k, v) + ((sink,) if sinks else ()):
        t.requires_grad_()
    if mask is None:
        mask = _reference_mask(position_ids if documents == "position_ids" else PLAIN, window)
    else:
        documents, window = "mask", None
    expected = _reference(q, k, v, mask, sink, softcap)
    (expected * weight).sum().backward()
    local = [shard_zigzag(t.detach(), world, rank, dim=2).requires_grad_() for t in (q, k, v)]
    local_sink = sink.detach().clone().requires_grad_() if sinks else None
    module = SimpleNamespace(is_causal=True)
    extra = {"s_aux": local_sink} if sinks else {}
    if softcap is not None:
        extra["softcap"] = softcap
    ring = RingAttention(dist.group.WORLD, position_ids, documents=documents)
    out, _ = ring(module, *local, mask if documents == "mask" else None, sliding_window=window, **extra)
    (out * shard_zigzag(weight, world, rank, dim=1)).sum().backward()
    torch.testing.assert_close(gather_zigzag(out.detach(), None, dim=1), expected.detach(), **TOL)
    for mine, full in zip(local, (q, k, v)):
        torch.testing.assert_close(gather_zigzag(mine.grad, None, dim=2), full.grad, **TOL)
    if sinks:
        dist.all_reduce(local_sink.grad)  # each rank holds its queries' part of a replicated parameter's gradient
        torch.testing.assert_close(local_sink.grad, sink.grad, **TOL)


def _padded(lefts=(), rights=()):
    """sdpa's bool mask [2, 1, S, S] of rows padded on the left (`lefts` pads per row: rows before them have no key)
    or on the right (`rights`)."""
    q, k = torch.arange(S)[:, None], torch.arange(S)[None, :]
    keys = torch.ones(2, S, dtype=torch.bool)
    for row, n in enumerate(lefts):
        keys[row, :n] = False
    for row, n in enumerate(rights):
        keys[row, S - n:] = False
    return ((k <= q)[None] & keys[:, None, :])[:, None]


def _additive(mask, masked=torch.finfo(torch.float32).min):
    """eager's additive form of a bool mask (0 attend, the dtype's minimum masked)."""
    return torch.zeros(mask.shape).masked_fill(~mask, masked)


class _Gather(torch.autograd.Function):
    """Every rank's zigzag part -> the full sequence. Every rank computes the same loss from it, so the gradient of
    this rank's part is its part of the full gradient."""

    @staticmethod
    def forward(ctx, x):
        return gather_zigzag(x, None, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return shard_zigzag(grad, dist.get_world_size(), dist.get_rank(), dim=1)


def _shard_layers(model):
    """What the plugin's integration does: the model's forward runs on the full sequence (embeddings, its own mask,
    rotary tables) up to the decoder layers; a pre-hook on each layer cuts its hidden states (the first layer's),
    rotary tables and position ids to this rank's zigzag part (the mask stays full: the ring adapter slices it); a
    hook on the final norm gathers the sequence back. Returns the hook handles."""
    world, rank = dist.get_world_size(), dist.get_rank()

    def cut(layer, args, kwargs):
        hidden, cos_sin = args[0], kwargs["position_embeddings"]
        if hidden.shape[1] == cos_sin[0].shape[1]:
            hidden = shard_zigzag(hidden, world, rank)
        kwargs["position_embeddings"] = tuple(shard_zigzag(t, world, rank) for t in cos_sin)
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = shard_position_ids(kwargs["position_ids"], world, rank)
        return (hidden,) + tuple(args[1:]), kwargs

    handles = [layer.register_forward_pre_hook(cut, with_kwargs=True) for layer in model.model.layers]
    return handles + [model.model.norm.register_forward_hook(lambda m, args, out: _Gather.apply(out))]


def _tiny(arch, impl):
    """A tiny LlamaForCausalLM, or Qwen2ForCausalLM with a full and a sliding-window layer (window 10 < S)."""
    import transformers
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    else:
        config = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=10,
                                          layer_types=["full_attention", "sliding_attention"])
    config._attn_implementation = impl
    torch.manual_seed(0)
    return getattr(transformers, f"{arch.capitalize()}ForCausalLM")(config)


CASES = {  # model inputs besides input_ids
    "packed": dict(position_ids=PACKED, use_cache=False),  # transformers isolates the documents
    "cache": dict(position_ids=PACKED, use_cache=True),  # a cache: one causal row (sdpa: no mask at all)
    "right": dict(attention_mask=torch.ones(2, S, dtype=torch.long).index_fill(1, torch.arange(40, S), 0)),
    "left": dict(attention_mask=(torch.arange(S)[None] >= torch.tensor([[13], [30]])).long()),  # rows without keys
}


def _check_model(impl, case, arch="llama", documents="mask"):
    """The ring model (registered with `impl`'s mask function) equals the one-process model using `impl`: logits
    and parameter gradients (summed over ranks where a rank holds part of them)."""
    reference = _tiny(arch, impl)
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 64, (2, S), generator=torch.Generator().manual_seed(1))
    weight = torch.randn(2, S, 64, generator=torch.Generator().manual_seed(2))
    logits = reference(input_ids=ids, **CASES[case]).logits
    (logits * weight).sum().backward()
    register_ring_attention(f"ring_{impl}", RingAttention(dist.group.WORLD, documents=documents), like=impl)
    model.config._attn_implementation = f"ring_{impl}"
    handles = _shard_layers(model)
    try:
        ring_logits = model(input_ids=ids, **CASES[case]).logits
    finally:
        for handle in handles:
            handle.remove()
    (ring_logits * weight).sum().backward()
    where = f"{arch} {impl} {case}"
    torch.testing.assert_close(ring_logits, logits, **TOL, msg=lambda m: f"{where} logits: {m}")
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        if not name.startswith("lm_head"):  # before the gather: this rank's tokens' part
            dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, ref.grad, **TOL, msg=lambda m: f"{where} {name}: {m}")


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
        RingAttention(dist.group.WORLD, documents="position_ids")(module, q, q, q, None, position_ids=torch.arange(5))
    with pytest.raises(ValueError, match="one of"):
        RingAttention(dist.group.WORLD, documents="packed")
    full = 4 * world
    with pytest.raises(ValueError, match="4-D mask of the full sequence"):
        ring(module, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))  # this rank's rows only
    with pytest.raises(ValueError, match="4-D mask of the full sequence"):
        ring(module, q, q, q, torch.ones(1, full, dtype=torch.bool))  # a 2-D padding mask
    alibi = -torch.arange(full, dtype=torch.float32).expand(1, 1, full, full)
    with pytest.raises(NotImplementedError, match="additive bias"):
        ring(module, q, q, q, alibi)


def _two_ranks():
    _check_refusals()
    _check_kernel(PLAIN)  # fused: causal diagonal blocks and full blocks
    _check_kernel(PLAIN, tile_rows=5)  # the hand-written fallback
    _check_kernel(PACKED)  # blocks with rows that have no key there (another document)
    _check_kernel(PLAIN, window=7)
    _check_kernel(PACKED, window=20)
    _check_kernel(PACKED, kv_heads=2)
    _check_kernel(PACKED, kv_heads=2, window=9, sinks=True)
    _check_kernel(PACKED, kv_heads=2, window=9, sinks=True, tile_rows=5)  # tiles of 5, 5, 2 rows per query head
    _check_kernel(PACKED, documents="causal")  # one causal row
    _check_kernel(PLAIN, kv_heads=2, mask=_reference_mask(PACKED, window=20))  # a mask given: blocks are its slices
    left = _padded(lefts=(13, 30))  # row 0's chunk 0 and row 1's chunks 0-1 query rows without any key
    _check_kernel(PLAIN, kv_heads=2, mask=left)
    _check_kernel(PLAIN, kv_heads=2, mask=left, tile_rows=5)
    _check_kernel(PLAIN, kv_heads=2, mask=_additive(left), tile_rows=5)  # eager: those rows uniform over all keys
    _check_kernel(PLAIN, mask=_additive(left, float("-inf")))  # -inf: those rows 0, as sdpa
    _check_kernel(PLAIN, mask=_padded(rights=(8, 20)))
    # Gemma 2's logit soft-capping (cap 1: most scores are capped hard), always the hand-written blocks
    _check_kernel(PACKED, kv_heads=2, window=9, softcap=1.0, tile_rows=5)
    _check_kernel(PLAIN, kv_heads=2, mask=_additive(left), softcap=1.0, tile_rows=5)  # eager's uniform rows
    _check_kernel(PLAIN, softcap=0.5, tile_rows=64)  # whole blocks, causal diagonals
    for impl in ("sdpa", "eager"):
        for case in CASES:
            _check_model(impl, case)
        _check_model(impl, "packed", arch="qwen2")
        _check_model(impl, "left", arch="qwen2")
    _check_model("sdpa", "packed", documents="position_ids")  # the documents of position ids: the same here


def _four_ranks():
    _check_kernel(PACKED, kv_heads=2, window=13)
    _check_kernel(PLAIN, kv_heads=2, mask=_additive(_padded(lefts=(13, 30))))
    _check_model("sdpa", "left", arch="qwen2")
    _check_model("eager", "packed")


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
    assert masks.kind(3, 2) is BlockKind.FULL and masks.kind(3, 3) is BlockKind.CAUSAL  # one document: causal
    assert BlockMasks(chunk=12, docs=documents(PACKED, 2)).kind(1, 1) is BlockKind.MASKED  # documents in the block
    window = BlockMasks(chunk=12, window=5)
    assert window.kind(1, 0) is BlockKind.MASKED and window.kind(2, 0) is BlockKind.SKIP
    assert window.kind(1, 1) is BlockKind.MASKED and BlockMasks(chunk=12, window=12).kind(1, 1) is BlockKind.CAUSAL


def test_model_mask_blocks():
    """Block kinds read off a full mask: causal as `BlockMasks`; left padding skips the blocks of padding keys (bool)
    but computes every block of the rows without any key when eager's minimum makes them uniform."""
    causal = _padded()
    assert analyse_mask(causal, 2) == (None, tuple(tuple(BlockMasks(12).kind(q, k) for k in range(4)) for q in range(4)))
    assert analyse_mask(_additive(causal), 2) == analyse_mask(causal, 2)
    left = _padded(lefts=(13, 13))
    kinds = model_mask(left, 2).kinds  # keys 0-12 padding: chunk 0's keys are never attended
    assert [kinds[q][0] for q in range(4)] == [BlockKind.SKIP] * 4 and kinds[2][1] is BlockKind.MASKED
    assert [kinds[q][q] for q in range(4)] == [BlockKind.SKIP, BlockKind.MASKED, BlockKind.CAUSAL, BlockKind.CAUSAL]
    rows, kinds = analyse_mask(_additive(left), 2)
    assert rows[:, 0, :, 0].sum(-1).tolist() == [13, 13] and kinds[0] == (BlockKind.MASKED,) * 4
    assert analyse_mask(_additive(left), 2, uniform=False)[0] is None
