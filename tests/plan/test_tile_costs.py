"""Ring-DTP's token tiles in the planner: what one more tile costs (measured with the ledger,
one rank, fp32) is what ``plan.costs`` charges, the default tile keeps those costs under
10 % of the tile's GEMM time at the paper's shape (and half of it does not), and the peak
term holds a tile, not a strip, whatever N is."""

from __future__ import annotations

import pytest
import torch

from megatron_flat.config import FlatConfig
from megatron_flat.plan.costs import (
    OPS_RING_PER_TILE,
    tile_overhead,
    tile_reread_bytes,
    vocab_counts,
)
from megatron_flat.plan.model import Layout, ModelSpec
from megatron_flat.plan.peaks import strip_geometry, vocab_term
from megatron_flat.runtime.ledger import count
from megatron_flat.vocab import ring_dtp_cross_entropy

H, V, BLOCK = 16, 512, 128  # 4 strips of 128 rows


def _ledger(n: int, tile_rows) -> dict:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, H, generator=gen).requires_grad_()
    w = torch.randn(V, H, generator=gen).requires_grad_()
    labels = torch.randint(0, V, (n,), generator=gen)
    tile = tile_rows * BLOCK * 4 if tile_rows else None

    def step():
        ring_dtp_cross_entropy(x, w, labels, block_size=BLOCK, tile_bytes=tile).sum().backward()

    step()  # the plan, then the steady state counted
    x.grad = w.grad = None
    return count(step)


@pytest.mark.parametrize("n", [64, 128])
def test_one_more_tile_costs_what_the_planner_charges(n) -> None:
    strips = V // BLOCK
    few, many = _ledger(n, n // 4), _ledger(n, n // 8)  # 4 and 8 tiles per strip
    extra = strips * 4  # tiles added
    assert many["ops"] - few["ops"] == extra * OPS_RING_PER_TILE
    moved = many["mem_bytes"] - few["mem_bytes"]
    # Beside the block re-reads, a tile moves a few per-tile scalars (< 64 bytes).
    assert 0 <= moved - extra * tile_reread_bytes(BLOCK, H, 4) < 64 * extra
    assert many["flops"] == few["flops"] and many["syncs"] == few["syncs"] == 0
    # The counts formula charges the same difference.
    def formula(tiles):
        return vocab_counts(hidden=H, vocab=V, tokens=n, tp=1, bytes_per_value=4,
                            sequence_parallel=False, flat=True, strips=strips, tiles=tiles,
                            width=BLOCK)
    assert formula(8)["ops"] - formula(4)["ops"] == extra * OPS_RING_PER_TILE
    assert formula(8)["mem_bytes"] - formula(4)["mem_bytes"] == \
        extra * tile_reread_bytes(BLOCK, H, 4)
    assert formula(1)["mem_bytes"] == 0


def test_the_default_tile_is_the_smallest_cheap_one_at_the_paper_shape() -> None:
    tile = FlatConfig().vocab_tile_bytes
    assert tile & (tile - 1) == 0  # a power of two
    # H 7168, bf16; strips of 6,250 rows (V/TP = 25,000 at TP 8) and of 8,192 (TP 1).
    for width in (6250, 8192):
        cost = tile_overhead(hidden=7168, width=width, tile_bytes=tile, bytes_per_value=2)
        assert cost["launch"] < 0.1 and cost["reread"] < 0.1, (width, cost)
        assert cost["tile_rows"] >= 4096
        half = tile_overhead(hidden=7168, width=width, tile_bytes=tile // 2, bytes_per_value=2)
        assert max(half["launch"], half["reread"]) >= 0.1, (width, half)


def test_strip_geometry_follows_the_op_plan() -> None:
    assert strip_geometry(25_000, 32_768, 8192, 0) == (6250, 32_768)
    assert strip_geometry(25_000, 32_768, 8192, 128 << 20) == (6250, 5368)
    assert strip_geometry(25_000, 1000, 8192, 128 << 20) == (6250, 1000)  # fits: untiled
    assert strip_geometry(2048, 10, 256, 64) == (16, 1)  # a tile narrower than a token's strip


def _model(**kw) -> ModelSpec:
    base = dict(name="tile-test", hidden=1024, heads=8, kv_heads=8, head_dim=128, layers=2,
                experts=8, topk=2, expert_ffn=512, vocab=65_536)
    base.update(kw)
    return ModelSpec(**base)


@pytest.mark.parametrize("tp", [1, 4])
def test_the_vocab_peak_holds_a_tile_not_a_strip(tp) -> None:
    model, layout = _model(), Layout(tp=tp, sp=tp > 1)
    tiled, whole = FlatConfig(vocab=True), FlatConfig(vocab=True, vocab_tile_bytes=0)

    def term(flat, n):
        n_sp = n // tp
        return vocab_term(model, layout, n, n_sp, flat)["value"]

    # Whole strips grow by 4·w bytes per token (two in flight at TP > 1); tiles stop at c.
    n1, n2 = 256 * 1024, 512 * 1024
    grow_whole = term(whole, n2) - term(whole, n1)
    grow_tiled = term(tiled, n2) - term(tiled, n1)
    assert grow_tiled < grow_whole / 2
    # What still grows with N is the per-token state and dX accumulator, not the strip.
    width, rows = strip_geometry(model.vocab // tp, n1 // tp, 8192, tiled.vocab_tile_bytes)
    assert rows < n1 // tp
    assert term(whole, n1) - term(tiled, n1) >= 4 * (n1 // tp - 2 * rows) * width
