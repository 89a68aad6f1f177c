"""Nothing of ours is written onto objects we do not own, and the layers take the axis they are split over: the tp
split of a parameter, a region's input, lazy marks live in registries; a config view is seen only during the call;
a layer given a group or None instead of an Axis is refused with the fix. One process, no process group."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.context import Axis
from shardformer.config_view import config_swapped, see_config_while_running
from shardformer.layer import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from shardformer.layer.region import RegionInput, region_input_of, set_region_input
from shardformer.layer.replicated import keep_own_heads
from shardformer.layer.spec import TPSpec, copy_tp_spec, get_tp_spec, set_tp_spec
from shardformer.layer.tensor_registry import unregistered
from shardformer.lazy_sources import expert_rows_of, set_expert_rows

ALONE = Axis.alone("tp")


def test_layers_take_an_axis() -> None:
    for build in (lambda tp: ColumnParallelLinear(4, 6, tp), lambda tp: RowParallelLinear(4, 6, tp),
                  lambda tp: VocabParallelEmbedding(10, 4, tp)):
        for wrong in (None, "tp"):
            with pytest.raises(TypeError, match=r"Axis\.of_group\('tp', group\)"):
                build(wrong)
        layer = build(ALONE)
        assert (layer.tp, layer.tp_group, layer.tp_size, layer.tp_rank) == (ALONE, None, 1, 0)
        assert copy.deepcopy(layer).tp is ALONE  # an axis is a process-wide handle, shared by copies
    with pytest.raises(TypeError, match=r"Axis\.alone\('tp'\)"):
        Axis.of_group("tp", None)


def test_specs_and_marks_live_beside_the_tensors() -> None:
    col = ColumnParallelLinear.from_native_module(nn.Linear(4, 6), ALONE, n_fused=2)
    for p in col.parameters():
        assert vars(p) == {}, vars(p)  # nothing written onto torch's parameters
    assert get_tp_spec(col.weight) == TPSpec(0, 2)
    twin = torch.zeros(3)  # equal values, another tensor: no spec (identity, not ==)
    plain = torch.zeros(3)
    set_tp_spec(plain, TPSpec(0))
    assert get_tp_spec(twin) is None and get_tp_spec(plain) == TPSpec(0)
    master = nn.Parameter(col.weight.detach().double())
    copy_tp_spec(col.weight, master)
    assert get_tp_spec(master) == get_tp_spec(col.weight)
    set_expert_rows(master, (2, 2))
    meta, new = torch.empty(3, device="meta"), torch.zeros(3)
    set_tp_spec(meta, TPSpec(0))
    with unregistered(meta, new):  # swap_tensors refuses a tensor with weak references
        torch.utils.swap_tensors(meta, new)
    assert meta.device.type == "cpu" and get_tp_spec(meta) == TPSpec(0) and expert_rows_of(master) == (2, 2)


def test_region_input_is_held_by_module() -> None:
    kv = nn.Linear(4, 4)
    keep_own_heads(kv, num_heads=2, tp=ALONE)
    col = ColumnParallelLinear(4, 4, ALONE)
    x = torch.randn(2, 4)
    region = RegionInput(x, None, members=(col, kv))
    set_region_input(kv, region)
    col.region_input = region  # the layer's view of the registry
    assert region_input_of(col) is region and region_input_of(kv) is region and "region_input" not in vars(kv)
    set_region_input(kv, None)
    assert region_input_of(kv) is None


def test_config_view_only_while_running() -> None:
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    attention = model.model.layers[0].self_attn
    own, view = attention.config, copy.copy(attention.config)
    seen = []
    attention.register_forward_hook(lambda module, args, output: seen.append(module.config))
    see_config_while_running(attention, view)
    model(torch.tensor([[1, 2, 3]]))
    assert seen == [view] and attention.config is own
    with pytest.raises(RuntimeError, match="inside"):
        with config_swapped(model.model, view):
            assert model.model.config is view
            raise RuntimeError("inside")
    assert model.model.config is own
