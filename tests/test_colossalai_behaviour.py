"""Attributes and arguments ColossalAI scripts use, with ColossalAI's semantics: one table, checked on 2 ranks."""
import os

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from booster_plugin import Booster, HybridParallelPlugin, StatefulDistributedSampler
from booster_plugin.compat import DistCoordinator
from tests import model_utils as mu
from tests.dist_utils import run_distributed


def _boosted(**kwargs) -> HybridParallelPlugin:
    plugin = HybridParallelPlugin(**kwargs)
    Booster(plugin=plugin).boost(mu.build("llama_lm"))  # 4 layers
    return plugin


def _resumed_batches(plugin: HybridParallelPlugin, start: int):
    """The batches of an epoch, from the `start`-th sample of this rank on (StatefulDistributedSampler)."""
    data = TensorDataset(torch.arange(16))
    loader = plugin.prepare_dataloader(data, batch_size=2, shuffle=True, seed=3,
                                       distributed_sampler_cls=StatefulDistributedSampler)
    loader.sampler.set_start_index(start)
    return type(loader.sampler), len(loader.sampler), [b[0].tolist() for b in loader]


def _cases():
    rank = dist.get_rank()
    coordinator = DistCoordinator()
    v = _boosted(pp_size=2, num_microbatches=2, pp_style="zbv", num_model_chunks=2)
    loop = _boosted(pp_size=2, num_microbatches=2)
    sp = HybridParallelPlugin(tp_size=2, enable_sequence_parallelism=True)
    tp = HybridParallelPlugin(tp_size=2)
    dp = HybridParallelPlugin()  # dp size 2
    full = _resumed_batches(dp, 0)[2]
    table = [  # (what, ours, ColossalAI's)
        ("DistCoordinator _rank, _local_rank, _world_size",
         (coordinator._rank, coordinator._local_rank, coordinator._world_size),
         (rank, int(os.environ.get("LOCAL_RANK", rank)), 2)),
        ("stage_manager.use_zbv (zbv, 1f1b)", (v.stage_manager.use_zbv, loop.stage_manager.use_zbv), (True, False)),
        ("stage_manager.get_rank()", v.stage_manager.get_rank(), rank),
        ("stage_indices, zbv: V chunks", v.stage_manager.stage_indices, [[(0, 1), (3, 4)], [(1, 2), (2, 3)]][rank]),
        ("stage_indices, 1f1b: one range", loop.stage_manager.stage_indices, [(0, 2), (2, 4)][rank]),
        ("sp_group with sequence parallelism: the tp group", sp.sp_group, sp.tp_group),
        ("sp_group without: this rank alone", dist.get_process_group_ranks(tp.sp_group), [rank]),
        ("mixed_dp_group: the dp group", (tp.mixed_dp_group, dp.mixed_dp_group), (tp.dp_group, dp.dp_group)),
        ("shard_config sequence parallelism",
         (sp.shard_config.enable_sequence_parallelism, sp.shard_config.sequence_parallelism_mode,
          tp.shard_config.enable_sequence_parallelism), (True, "split_gather", False)),
        ("shard_config groups", (sp.shard_config.tensor_parallel_process_group, loop.shard_config.pipeline_stage_manager),
         (sp.tp_group, loop.stage_manager)),
        ("prepare_dataloader(distributed_sampler_cls=StatefulDistributedSampler), set_start_index(4)",
         _resumed_batches(dp, 4), (StatefulDistributedSampler, 4, full[2:])),
    ]
    wrong = [f"{what}: {ours!r}, ColossalAI: {theirs!r}" for what, ours, theirs in table if ours != theirs]
    assert not wrong, "\n".join(wrong)


def test_colossalai_behaviour_two_ranks():
    run_distributed(2, _cases)
