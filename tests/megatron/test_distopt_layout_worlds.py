"""megatron.distopt_layout against the buffers and shards Megatron builds itself.

Stock Megatron (no megatron-flat) with the distributed optimizer on the tiny MoE GPT, at
2 and 4 ranks (dense DP 2 / 4, expert DP 1 / 2), in fp32 and bf16, in one bucket and in
buckets of a few thousand elements (so that parameters straddle shards and buckets): for
every DDP buffer, dense and expert, the computed layout is the buffer's own parameter
index map and bucket ranges; this rank's pieces are the distributed optimizer's shard
ranges; the order per param group is the one its optimizer lists them in.
"""

import pytest
import torch

from megatron_flat.megatron.distopt_layout import buffer_layout, group_order
from megatron_flat.testing.distributed import megatron_layout
from megatron_flat.testing.tiny_gpt import TinyMoE
from megatron_flat.testing.training import Layout, Trainer
from tests._worlds import per_world

CASES = per_world({2: ["ep1-fp32", "ep2-bf16-buckets"],
                   4: ["ep2-fp32", "ep2-bf16-buckets", "ep2-fp32-buckets", "ep4-bf16"]})


def _distopts(optimizer):
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer])]


@pytest.mark.parametrize("world, case", CASES)
def test_layout_and_shards_are_megatrons(megatron_cpu, world, case):
    ep = int(case.split("-")[0][2:])
    bucket = 3000 if "buckets" in case else None
    overrides = dict(bf16=True, params_dtype=torch.bfloat16) if "bf16" in case else {}
    tiny = TinyMoE(num_experts=4, topk=2, num_layers=3, global_batch_size=2 * world)
    layout = Layout(ep=ep, distributed_optimizer=True, overlap_grad_reduce=bucket is not None,
                    bucket_size=bucket)
    with megatron_layout(ep=ep):
        trainer = Trainer(tiny, layout, config_overrides=overrides)
        ddp = trainer.ddp
        checked = 0
        cut = False  # some parameter split between ranks or buckets: the hard case ran
        for optimizer in _distopts(trainer.optimizer):
            group_of = {id(p): g for g, group in enumerate(optimizer.opt_group_ranges)
                        for p in group["params"]}
            for buffer, ranges in zip(optimizer.buffers, optimizer.gbuf_ranges):
                params = buffer.params
                world_size = buffer.data_parallel_group.size()
                rank = buffer.data_parallel_group.rank()
                got = buffer_layout([p.numel() for p in params], world_size, ddp.bucket_size)
                assert [got.index[i] for i in range(len(params))] == \
                    [tuple(buffer.param_index_map[p]) for p in params]
                assert list(got.buckets) == [(b.offset, b.offset + b.grad_data.numel())
                                             for b in buffer.buckets]
                # this rank's pieces: the shard ranges of every bucket, in buffer order
                (bucket_maps,) = ranges.values()
                position = {id(p): i for i, p in enumerate(params)}
                want = [(position[id(p)], r["param"].start, r["param"].end)
                        for m in bucket_maps for p, r in m["param_map"].items()]
                pieces = got.pieces(rank)
                assert [(x.param, x.start, x.stop) for x in pieces] == want
                cut |= any(x.numel != params[x.param].numel() for x in pieces)
                cut |= len(got.buckets) > 1
                # the optimizer's order: per param group, in buffer order (one dtype here)
                order = group_order(pieces, [group_of.get(id(p), 0) for p in params],
                                    [p.dtype == torch.float32 for p in params],
                                    num_groups=len(optimizer.opt_group_ranges))
                mine = {id(p) for p in params}
                for g, group in enumerate(optimizer.opt_group_ranges):
                    assert [id(params[x.param]) for x in order[g]] == \
                        [id(p) for p in group["params"] if id(p) in mine]
                checked += 1
        assert checked == len(ddp.buffers) + len(ddp.expert_parallel_buffers) >= 1 + (ep > 1)
        if bucket is not None:
            assert cut
