"""Tensor-parallel layers against their unsharded nn counterparts (fp32, gloo/CPU).

All cases for one world size run in a single spawned group because process-group start-up dominates the cost.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.pytorch_utils import Conv1D

from pipeline.context import Axis
from shardformer.layer import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPRNGTracker,
    TPSpec,
    VocabParallelEmbedding,
    gather_tensor,
    get_tp_spec,
    padded_size,
    parallel_causal_lm_loss,
    shard_tensor,
    vocab_parallel_cross_entropy,
    vocab_parallel_lm_head,
    wrap_module_forward_in_local_rng,
)
from shardformer.layer.comm import _exchange_partners, start_sum
from shardformer.layer.dropout import wrap_model_forward_in_tracker_rng
from shardformer.layer.region import RegionInput
from shardformer.layer.spec import zero_padding
from tests.dist_utils import run_distributed

TOL = dict(atol=1e-5, rtol=1e-5)
LOSS_TOL = dict(atol=1e-6, rtol=1e-6)


def _tp(group) -> Axis:
    return Axis.of_group("tp", group if group is not None else dist.group.WORLD)


def _rw(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _chunk(t: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    rank, world = _rw(group)
    return t.chunk(world, dim)[rank]


def _check_param_grads(par: nn.Module, ref: nn.Module, group) -> None:
    """Each sharded grad equals this rank's shard of the full grad; replicated grads equal the full grad."""
    rank, world = _rw(group)
    for name, p in par.named_parameters():
        full = ref.get_parameter(name).grad
        if full is None:  # frozen
            assert p.grad is None and not p.requires_grad, name
            continue
        spec = get_tp_spec(p)
        expected = full if spec is None else shard_tensor(full, spec, rank, world)
        assert_close(p.grad, expected, **TOL, msg=lambda m: f"grad of {name}: {m}")
        if spec is not None:
            assert_close(gather_tensor(p.grad, spec, group), full, **TOL)


def _check_gathered_weights(par: nn.Module, ref: nn.Module, group) -> None:
    for name, p in par.named_parameters():
        spec = get_tp_spec(p)
        full = p.detach() if spec is None else gather_tensor(p, spec, group)
        assert torch.equal(full, ref.get_parameter(name).detach()), name
    if hasattr(par, "unsharded_state_dict"):  # the layer itself gives the native module's full state_dict
        full = par.unsharded_state_dict()
        native = ref.state_dict()
        assert full.keys() == native.keys(), (full.keys(), native.keys())
        for name, tensor in native.items():
            assert torch.equal(full[name], tensor), name


def _all_equal_across(t: torch.Tensor, group) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(torch.equal(parts[0], p) for p in parts[1:])


def _all_distinct_across(t: torch.Tensor, group) -> bool:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(not torch.equal(parts[i], parts[j]) for i in range(len(parts)) for j in range(i))


# ---------------------------------------------------------------- linear layers


def case_column_linear(group) -> None:
    for bias in (True, False):
        for gather in (True, False):
            torch.manual_seed(0)
            ref = nn.Linear(10, 24, bias=bias)
            x = torch.randn(3, 5, 10, requires_grad=True)
            g = torch.randn(3, 5, 24)
            par = ColumnParallelLinear.from_native_module(ref, _tp(group), gather_output=gather)
            _check_gathered_weights(par, ref, group)
            xp = _leaf(x)
            y_ref, y = ref(x), par(xp)
            y_ref.backward(g)
            if gather:
                assert_close(y, y_ref, **TOL)
                y.backward(g)
            else:
                assert_close(y, _chunk(y_ref, group), **TOL)
                y.backward(_chunk(g, group))
            assert_close(xp.grad, x.grad, **TOL)
            _check_param_grads(par, ref, group)


def case_column_conv1d(group) -> None:
    torch.manual_seed(1)
    ref = Conv1D(24, 10)  # nf=out, nx=in
    x = torch.randn(2, 6, 10, requires_grad=True)
    g = torch.randn(2, 6, 24)
    par = ColumnParallelLinear.from_native_module(ref, _tp(group), gather_output=True)
    assert par.is_conv1d and get_tp_spec(par.weight).dim == 1 and par.weight.shape == (10, 24 // _rw(group)[1])
    _check_gathered_weights(par, ref, group)
    xp = _leaf(x)
    y_ref, y = ref(x), par(xp)
    assert_close(y, y_ref, **TOL)
    y_ref.backward(g)
    y.backward(g)
    assert_close(xp.grad, x.grad, **TOL)
    _check_param_grads(par, ref, group)


def case_fused_c_attn(group) -> None:
    rank, world = _rw(group)
    hidden = 8
    step = hidden // world
    for gather in (False, True):
        torch.manual_seed(2)
        ref = Conv1D(3 * hidden, hidden)
        x = torch.randn(2, 5, hidden, requires_grad=True)
        g = torch.randn(2, 5, 3 * hidden)
        par = ColumnParallelLinear.from_native_module(ref, _tp(group), gather_output=gather, n_fused=3)
        _check_gathered_weights(par, ref, group)
        xp = _leaf(x)
        y_ref, y = ref(x), par(xp)
        y_ref.backward(g)
        # explicit [q_r, k_r, v_r] slices, independent of shard_tensor
        cols = torch.cat([torch.arange(a * hidden + rank * step, a * hidden + (rank + 1) * step) for a in range(3)])
        if gather:
            assert_close(y, y_ref, **TOL)
            y.backward(g)
        else:
            assert_close(y, y_ref[..., cols], **TOL)
            y.backward(g[..., cols])
        assert_close(xp.grad, x.grad, **TOL)
        assert_close(par.weight, ref.weight[:, cols], atol=0, rtol=0)
        assert_close(par.weight.grad, ref.weight.grad[:, cols], **TOL)
        assert_close(par.bias.grad, ref.bias.grad[cols], **TOL)


def case_row(group) -> None:
    for make_ref in (lambda: nn.Linear(24, 10), lambda: Conv1D(10, 24)):
        for input_is_parallel in (True, False):
            torch.manual_seed(3)
            ref = make_ref()
            x = torch.randn(4, 3, 24, requires_grad=True)
            g = torch.randn(4, 3, 10)
            par = RowParallelLinear.from_native_module(ref, _tp(group), input_is_parallel=input_is_parallel)
            assert get_tp_spec(par.bias) is None
            _check_gathered_weights(par, ref, group)
            xp = _leaf(_chunk(x, group) if input_is_parallel else x)
            y_ref, y = ref(x), par(xp)
            assert_close(y, y_ref, **TOL)
            y_ref.backward(g)
            y.backward(g)
            assert_close(xp.grad, _chunk(x.grad, group) if input_is_parallel else x.grad, **TOL)
            _check_param_grads(par, ref, group)


class _MLP(nn.Module):
    def __init__(self, fc: nn.Module, proj: nn.Module) -> None:
        super().__init__()
        self.fc, self.proj = fc, proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def case_mlp(group) -> None:
    for fc, proj in ((lambda: nn.Linear(10, 32), lambda: nn.Linear(32, 10)), (lambda: Conv1D(32, 10), lambda: Conv1D(10, 32))):
        torch.manual_seed(4)
        ref = _MLP(fc(), proj())
        par = _MLP(ColumnParallelLinear.from_native_module(ref.fc, _tp(group)),
                   RowParallelLinear.from_native_module(ref.proj, _tp(group)))
        x = torch.randn(3, 7, 10, requires_grad=True)
        g = torch.randn(3, 7, 10)
        xp = _leaf(x)
        y_ref, y = ref(x), par(xp)
        assert_close(y, y_ref, **TOL)
        y_ref.backward(g)
        y.backward(g)
        assert_close(xp.grad, x.grad, **TOL)
        _check_param_grads(par, ref, group)


class _GatedMLP(nn.Module):
    """gate and up read one input (a tp region when sharded; up twice, so its output gradients add up)."""

    def __init__(self, gate: nn.Module, up: nn.Module, down: nn.Module, group=None, sharded: bool = False) -> None:
        super().__init__()
        self.gate, self.up, self.down, self.group, self.sharded = gate, up, down, group, sharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sharded:
            self.gate.region_input = self.up.region_input = RegionInput(x, self.group, members=(self.gate, self.up))
        return self.down(F.silu(self.gate(x)) * self.up(x) + self.up(x))


def _graph_has(t: torch.Tensor, name: str) -> bool:
    seen, stack = set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == name:
            return True
        stack.extend(child for child, _ in node.next_functions)
    return False


def case_deferred_weight_grads(group) -> None:
    """A region's column layers compute their weight gradients in the region entry's backward, while the input
    gradient is summed: the same gradients as the unsharded layers, with or without deferral, with a frozen layer."""
    for make in (lambda i, o: nn.Linear(i, o), lambda i, o: Conv1D(o, i)):
        for defer, frozen in ((True, False), (False, False), (True, True)):
            torch.manual_seed(5)
            ref = _GatedMLP(make(10, 16), make(10, 16), make(16, 10))
            ref.gate.weight.requires_grad_(not frozen)
            par = _GatedMLP(ColumnParallelLinear.from_native_module(ref.gate, _tp(group)),
                            ColumnParallelLinear.from_native_module(ref.up, _tp(group)),
                            RowParallelLinear.from_native_module(ref.down, _tp(group)), group, sharded=True)
            par.gate.defer_weight_grad = par.up.defer_weight_grad = defer
            x, g = torch.randn(3, 5, 10, requires_grad=True), torch.randn(3, 5, 10)
            xp = _leaf(x)
            y_ref, y = ref(x), par(xp)
            assert_close(y, y_ref, **TOL)
            assert _graph_has(y, "_EnterDeferringBackward") == defer, (defer, frozen)
            region = par.up.region_input
            assert region.defers(par.up) == defer and region.defers(par.gate) == (defer and not frozen)
            y_ref.backward(g)
            y.backward(g)
            assert_close(xp.grad, x.grad, **TOL)
            _check_param_grads(par, ref, group)
            assert (par.gate.weight.grad is None) == frozen


def case_sum_over_group(group) -> None:
    """start_sum equals all_reduce, the same bits on every rank; `x` stays untouched unless summed in place. With
    gloo, power-of-two groups exchange with partners up to 2 MiB (a 2.3 MiB tensor all-reduces); other sizes (a
    3-rank group in the 4-rank world) all-reduce."""
    groups = [group]
    if group is None and dist.get_world_size() == 4:
        three = dist.new_group([0, 1, 2])
        groups += [three] if dist.get_rank() < 3 else []
    for grp, shape in [(grp, shape) for grp in groups for shape in ((37, 5), (600, 1024))]:
        torch.manual_seed(100 + dist.get_rank())
        x = torch.randn(*shape)
        expected, kept = x.clone(), x.clone()
        dist.all_reduce(expected, group=grp)
        for source in (x, x.t()):  # contiguous, and not
            out = start_sum(source, grp).wait()
            assert out is not source and torch.equal(x, kept)
            assert_close(out, expected if source is x else expected.t(), atol=1e-6, rtol=1e-6)
            assert _all_equal_across(out, grp)
        exchanged = dist.get_world_size(grp) in (2, 4) and x.numel() * 4 <= 2 << 20
        assert (_exchange_partners(grp, x.numel() * 4) is not None) == exchanged
        y = x.clone()
        assert start_sum(y, grp, in_place=True).wait() is y and _all_equal_across(y, grp)
        assert_close(y, expected, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- embedding, LM head, loss


def case_embedding(group) -> None:
    rank, world = _rw(group)
    for divisible_by in (1, 8):
        for padding_idx in (3, 30):
            torch.manual_seed(5)
            ref = nn.Embedding(50, 6, padding_idx=padding_idx)
            par = VocabParallelEmbedding.from_native_module(ref, _tp(group),
                                                            make_vocab_size_divisible_by=divisible_by)
            padded = padded_size(50, world, divisible_by)
            assert (par.num_embeddings, par.padded_num_embeddings) == (50, padded)
            assert (par.vocab_start, par.vocab_end) == (rank * padded // world, (rank + 1) * padded // world)
            assert par.weight.shape == (padded // world, 6)
            _check_gathered_weights(par, ref, group)
            n_real = max(0, min(par.vocab_end, 50) - par.vocab_start)
            assert not par.weight[n_real:].any()  # pad rows are zero
            ids = torch.randint(0, 50, (4, 9))
            ids[0, :3] = padding_idx
            ids[1, 0], ids[1, 1] = 0, 49
            g = torch.randn(4, 9, 6)
            y_ref, y = ref(ids), par(ids)
            assert_close(y, y_ref, **TOL)
            y_ref.backward(g)
            y.backward(g)
            assert not ref.weight.grad[padding_idx].any()
            _check_param_grads(par, ref, group)


def case_tied_lm_head(group) -> None:
    for gather in (False, True):
        torch.manual_seed(6)
        emb = nn.Embedding(50, 8)
        head = nn.Linear(8, 50, bias=False)
        head.weight = emb.weight
        ids = torch.randint(0, 50, (2, 11))
        labels = torch.randint(0, 50, (2, 11))
        labels[0, :4] = -100
        logits_ref = head(emb(ids))
        loss_ref = F.cross_entropy(logits_ref.view(-1, 50), labels.view(-1))
        loss_ref.backward()

        pemb = VocabParallelEmbedding.from_native_module(emb, _tp(group), make_vocab_size_divisible_by=8)
        phead = vocab_parallel_lm_head(head, _tp(group), gather_output=gather, padded_vocab=pemb.padded_num_embeddings)
        assert torch.equal(phead.weight, pemb.weight) and get_tp_spec(phead.weight) == get_tp_spec(pemb.weight)
        phead.weight = pemb.weight  # re-tie
        logits = phead(pemb(ids))
        if gather:
            assert_close(logits, logits_ref, **TOL)
            loss = F.cross_entropy(logits.view(-1, 50), labels.view(-1))
        else:
            assert phead.output_start == pemb.vocab_start
            loss = vocab_parallel_cross_entropy(logits, labels, group, phead.output_start, vocab_size=50)
        assert_close(loss, loss_ref, **TOL)
        loss.backward()
        assert_close(gather_tensor(pemb.weight.grad, get_tp_spec(pemb.weight), group), emb.weight.grad, **TOL)


def _padded_logits(shape: tuple[int, ...], vocab: int, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full logits (..., vocab) and a padded copy whose pad columns hold large garbage."""
    full = 3 * torch.randn(*shape, vocab)
    garbage = 50 + torch.randn(*shape, padded - vocab)
    return full, torch.cat([full, garbage], -1)


def case_cross_entropy(group) -> None:
    rank, world = _rw(group)
    vocab, padded = 50, padded_size(50, world, 8)
    per = padded // world
    for reduction in ("mean", "sum", "none"):
        torch.manual_seed(7)
        full, with_pad = _padded_logits((6, 7), vocab, padded)
        target = torch.randint(0, vocab, (6, 7))
        target[0, :5] = -100
        target[3, 2] = vocab - 1
        target[4, 1] = 0
        full = full.requires_grad_()
        local = _leaf(with_pad[..., rank * per:(rank + 1) * per])
        ref = F.cross_entropy(full.view(-1, vocab), target.view(-1), reduction=reduction)
        loss = vocab_parallel_cross_entropy(local, target, group, rank * per, reduction=reduction, vocab_size=vocab)
        if reduction == "none":
            ref = ref.view(6, 7)
            w = torch.randn(6, 7)
            assert_close(loss, ref, **LOSS_TOL)
            ref, loss = (ref * w).sum(), (loss * w).sum()
        assert_close(loss, ref, **LOSS_TOL)
        ref.backward()
        loss.backward()
        expected = F.pad(full.grad, (0, padded - vocab))[..., rank * per:(rank + 1) * per]
        assert_close(local.grad, expected, **LOSS_TOL)
    # the backward turns the saved softmax into the gradient in place: a second backward is refused, not wrong
    loss = vocab_parallel_cross_entropy(local, target, group, rank * per, vocab_size=vocab)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass"):
        loss.backward()


def case_causal_lm_loss(group) -> None:
    rank, world = _rw(group)
    vocab, padded = 50, padded_size(50, world, 1)
    per = padded // world
    for num_items in (None, torch.tensor(11)):
        torch.manual_seed(8)
        full, with_pad = _padded_logits((2, 9), vocab, padded)
        labels = torch.randint(0, vocab, (2, 9))
        labels[1, :3] = -100
        full = full.requires_grad_()
        local = _leaf(with_pad[..., rank * per:(rank + 1) * per])
        ref = ForCausalLMLoss(full, labels, vocab, num_items_in_batch=num_items)
        loss = parallel_causal_lm_loss(local, labels, vocab, group, rank * per, num_items_in_batch=num_items)
        assert_close(loss, ref, **LOSS_TOL)
        ref.backward()
        loss.backward()
        expected = F.pad(full.grad, (0, padded - vocab))[..., rank * per:(rank + 1) * per]
        assert_close(local.grad, expected, **LOSS_TOL)


# ---------------------------------------------------------------- specs


def case_spec_round_trip(group) -> None:
    rank, world = _rw(group)
    torch.manual_seed(9)
    cases = [
        (torch.randn(12, 5), TPSpec(0)),
        (torch.randn(5, 12), TPSpec(1)),
        (torch.randn(24, 5), TPSpec(0, n_fused=3)),
        (torch.randn(5, 24), TPSpec(-1, n_fused=3)),
        (torch.randn(10, 3), TPSpec(0, full_size=10)),
        (torch.randn(10, 3), TPSpec(0, full_size=10, padded=16)),
        (torch.randn(3, 5), TPSpec(1, full_size=5, padded=8)),
    ]
    for full, spec in cases:
        local = shard_tensor(full, spec, rank, world)
        assert local.is_contiguous() and local.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
        assert torch.equal(gather_tensor(local, spec, group), full), spec
    # fused areas split separately, not naive chunking
    full = torch.arange(24.0)
    area, step = 8, 8 // world
    expected = torch.cat([full[a * area + rank * step:a * area + (rank + 1) * step] for a in range(3)])
    assert torch.equal(shard_tensor(full, TPSpec(0, n_fused=3), rank, world), expected)
    # padding rows are zero and sit at the end
    local = shard_tensor(torch.ones(10, 2), TPSpec(0, full_size=10, padded=16), rank, world)
    per = 16 // world
    assert torch.equal(local[:, 0], (torch.arange(rank * per, (rank + 1) * per) < 10).float())
    assert padded_size(50, 4, 8) == 64 and padded_size(50, 4, 1) == 52 and padded_size(64, 2, 8) == 64


# ---------------------------------------------------------------- dropout RNG


def case_dropout_rng(group) -> None:
    rank, _ = _rw(group)
    torch.manual_seed(100 + dist.get_rank())  # ranks start out different
    x = torch.ones(4096)
    drop = nn.Dropout(0.5).train()
    assert _all_distinct_across(drop(x), group)

    tracker = TPRNGTracker()
    script = torch.get_rng_state()
    tracker.sync(group, base_seed=1234 + dist.get_rank())  # the group's first rank's seed wins
    assert torch.equal(torch.get_rng_state(), script), "sync touched the script's RNG"
    with tracker.model_rng():  # as the model's forward: the shared state, the same on every rank
        assert _all_equal_across(drop(x), group)
        before_local = torch.get_rng_state()
        with tracker.local_rng():
            m1 = drop(x)
        assert torch.equal(torch.get_rng_state(), before_local)
        assert _all_distinct_across(m1, group)
        with tracker.local_rng():
            m2 = drop(x)
        assert not torch.equal(m1, m2)  # the private state advances between uses

        after = drop(x)
        torch.set_rng_state(before_local)
        assert torch.equal(drop(x), after)  # local use did not consume the shared stream
        assert _all_equal_across(after, group)
    assert torch.equal(torch.get_rng_state(), script), "the model's draws advanced the script's RNG"

    # module hooks: dropout inside the wrapped module is per rank, the shared stream is untouched
    inner = nn.Sequential(nn.Identity(), nn.Dropout(0.5))
    handles = wrap_module_forward_in_local_rng(inner, tracker)
    with tracker.model_rng():
        state = torch.get_rng_state()
        assert _all_distinct_across(inner(x), group)
        assert torch.equal(torch.get_rng_state(), state)
        assert _all_equal_across(drop(x), group)
    for h in handles:
        h.remove()
    # the whole model under the shared state, also when its forward ends by an exception
    outer = nn.Sequential(nn.Dropout(0.5))
    handles = wrap_model_forward_in_tracker_rng(outer, tracker)
    assert _all_equal_across(outer(x), group) and torch.equal(torch.get_rng_state(), script)
    for h in handles:
        h.remove()
    failing = nn.Sequential(nn.Dropout(0.5), nn.Linear(3, 3))  # draws, then fails on the 4096 features
    wrap_model_forward_in_tracker_rng(failing, tracker)
    script = torch.get_rng_state()  # (building the Linear drew from it)
    with pytest.raises(RuntimeError):
        failing(x)
    assert torch.equal(torch.get_rng_state(), script)


CASES = [
    case_spec_round_trip,
    case_column_linear,
    case_column_conv1d,
    case_fused_c_attn,
    case_row,
    case_mlp,
    case_deferred_weight_grads,
    case_sum_over_group,
    case_embedding,
    case_tied_lm_head,
    case_cross_entropy,
    case_causal_lm_loss,
    case_dropout_rng,
]


def _run_cases() -> None:
    world = dist.get_world_size()
    groups = [None]
    if world == 4:  # also run on 2-rank subgroups, where group ranks differ from global ranks
        subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups.append(subgroups[dist.get_rank() // 2])
    for group in groups:
        for case in CASES:
            try:
                case(group)
            except Exception as e:
                raise AssertionError(f"{case.__name__} (group size {dist.get_world_size(group)}) failed") from e


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_layers(world_size: int) -> None:
    run_distributed(world_size, _run_cases)


def test_single_process_is_identity() -> None:
    """Without an initialized process group the layers fall back to the plain computation."""
    assert not dist.is_initialized()
    torch.manual_seed(10)
    ref = nn.Linear(6, 5)
    col = ColumnParallelLinear.from_native_module(ref, Axis.alone("tp"), gather_output=True, padded_out_features=8)
    row = RowParallelLinear.from_native_module(ref, Axis.alone("tp"))
    x = torch.randn(3, 6)
    assert_close(col(x), ref(x), **TOL)
    assert_close(row(x), ref(x), **TOL)
    emb = nn.Embedding(11, 4, padding_idx=2)
    ids = torch.randint(0, 11, (5,))
    assert_close(VocabParallelEmbedding.from_native_module(emb, Axis.alone("tp"), 4)(ids), emb(ids), **TOL)
    logits, target = torch.randn(7, 11), torch.randint(0, 11, (7,))
    assert_close(vocab_parallel_cross_entropy(logits, target, None, 0), F.cross_entropy(logits, target), **LOSS_TOL)


def test_zero_padding_matches_the_shard_layout() -> None:
    """A fresh init zeroes exactly the entries `shard_tensor` pads (vocab padding, fused areas included), on every
    rank; reset_parameters of a padded column layer and embedding does."""
    for spec, size in ((TPSpec(0, 1, 11, 16), 11), (TPSpec(1, 2, 10, 16), 10), (TPSpec(0, 1, 8), 8)):
        full = torch.ones(size, 3) if spec.dim == 0 else torch.ones(3, size)
        for rank in range(4):
            expected = shard_tensor(full, spec, rank, 4)
            fresh = torch.ones_like(expected)
            zero_padding(fresh, spec, rank, 4)
            assert torch.equal(fresh, expected), (spec, rank)
    col = ColumnParallelLinear(6, 5, Axis.alone("tp"), padded_out_features=8)
    assert col.weight[5:].abs().sum() == 0 and col.weight[:5].abs().sum() > 0 and col.bias[5:].abs().sum() == 0
    emb = VocabParallelEmbedding(11, 4, Axis.alone("tp"), make_vocab_size_divisible_by=4)
    assert emb.weight.shape[0] == 12 and emb.weight[11:].abs().sum() == 0 and emb.weight[:11].abs().sum() > 0
