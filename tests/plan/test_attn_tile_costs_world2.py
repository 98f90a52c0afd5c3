"""What one more attention tile costs, counted by the ledger at TP 2 (gloo), is what
``plan.costs`` charges per tile: ``OPS_ATTN_TILE_FORWARD`` / ``_BACKWARD`` launches,
``ATTN_TILE_CALLS_FORWARD`` / ``_BACKWARD`` collectives, the weights read again in each
forward and dX GEMM and the fp32 accumulator read and written in each dW GEMM; FLOPs and
collective bytes unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_flat.attention import SequenceTiles, tiled_gather_linear, tiled_linear_reduce_scatter
from megatron_flat.plan.costs import (
    ATTN_TILE_CALLS_BACKWARD,
    ATTN_TILE_CALLS_FORWARD,
    OPS_ATTN_TILE_BACKWARD,
    OPS_ATTN_TILE_FORWARD,
    TILE_REREAD_FP32_BYTES,
    attn_tile_counts,
)
from megatron_flat.runtime.ledger import count

pytestmark = pytest.mark.world(2)

N_LOCAL, MB, H, OUT = 64, 2, 16, 24


def _counts(tiles: int, backward: bool, rank: int) -> dict:
    """The ledger's counts of the block's two projections (QKV gather + GEMM, output GEMM +
    reduce-scatter), forward or forward + backward, in ``tiles`` tiles; after a warm-up."""
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(N_LOCAL, MB, H, generator=gen).requires_grad_(backward)
    w_qkv = torch.randn(OUT, H, generator=gen).requires_grad_(backward)
    w_proj = torch.randn(H, OUT, generator=gen).requires_grad_(backward)
    plan = SequenceTiles(N_LOCAL, dist.get_world_size(), N_LOCAL // tiles)

    def block():
        y = tiled_gather_linear(x, w_qkv, plan, group=dist.group.WORLD)
        z = tiled_linear_reduce_scatter(y, w_proj, plan, group=dist.group.WORLD)
        if backward:
            z.sum().backward()

    block()
    return count(block)


def test_one_more_tile_costs_what_the_planner_charges(dist_world):
    assert dist_world == 2
    rank = dist.get_rank()
    params = 2 * OUT * H  # both projections' weights
    for backward in (False, True):
        few, many = _counts(4, backward, rank), _counts(8, backward, rank)
        extra = 4  # tiles added
        ops = OPS_ATTN_TILE_FORWARD + (OPS_ATTN_TILE_BACKWARD if backward else 0)
        assert many["ops"] - few["ops"] == extra * ops, backward
        calls = {k: ATTN_TILE_CALLS_FORWARD[k] + (ATTN_TILE_CALLS_BACKWARD[k] if backward else 0)
                 for k in ATTN_TILE_CALLS_FORWARD}
        for name, per_tile in calls.items():
            assert many["collective_calls"][name] - few["collective_calls"][name] == \
                extra * per_tile, (backward, name)
        # fp32 weights: read again per forward tile (4 B), and per backward tile by the dX
        # GEMMs (4 B) and the dW accumulation (read + write, 8 B).
        reread = (4 + (4 + TILE_REREAD_FP32_BYTES if backward else 0)) * params
        assert many["mem_bytes"] - few["mem_bytes"] == extra * reread, backward
        assert many["flops"] == few["flops"]
        assert many["other_collective_bytes"] == few["other_collective_bytes"]
        assert many["syncs"] == few["syncs"] == 0
    # The formula (forward twice under full recompute) charges the same per tile.
    one_pass = attn_tile_counts(projection_params=params, tiles=2, bytes_per_value=4,
                                recompute=False)
    assert one_pass["ops"] == OPS_ATTN_TILE_FORWARD + OPS_ATTN_TILE_BACKWARD
    assert one_pass["mem_bytes"] == (2 * 4 + TILE_REREAD_FP32_BYTES) * params
