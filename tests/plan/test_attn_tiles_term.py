"""The planner's attention term with sequence tiles (``FlatConfig.attn_tiles``): the gathered
N × H before the QKV projection becomes one gathered tile; nothing else moves. ``fit`` turns
the tiles on last, only where they apply; the step-time model charges their launches,
collective calls and weight re-reads; ``max_context`` reports the reach without them too."""

import dataclasses

import pytest

from megatron_flat.config import FlatConfig
from megatron_flat.plan.costs import (
    ATTN_TILE_TOKENS,
    OPS_ATTN_TILE_BACKWARD,
    OPS_ATTN_TILE_FORWARD,
    attn_tile_counts,
    attn_tile_overhead,
    attn_tiles,
    unit_costs,
)
from megatron_flat.plan.fit import TECHNIQUES, fit, max_context
from megatron_flat.plan.model import PAPER_GPUS, Layout, PlanError, default_layout, load_model
from megatron_flat.plan.peaks import attn_tile_rows, estimate, other_term


def test_tile_rows():
    assert attn_tile_rows(1 << 20, 8, 0) == 1 << 20  # off: all N
    assert attn_tile_rows(1 << 20, 8, 4096) == 4096
    assert attn_tile_rows(1 << 20, 8, 4100) == 4096  # whole rows per rank
    assert attn_tile_rows(1 << 20, 8, 3) == 8  # at least one row per rank
    assert attn_tile_rows(1000, 2, 1 << 20) == 1000  # at most N


@pytest.mark.parametrize("name", ["paper-120b", "paper-667b"])
def test_the_gathered_sequence_becomes_one_tile(name):
    model = load_model(name)
    layout = Layout(tp=2, cp=8, ep=16, sp=True)
    n = (1 << 20) // layout.cp
    n_sp = n // layout.tp
    stock = other_term(model, layout, n, n_sp, False)
    tiled = other_term(model, layout, n, n_sp, False, attn_tile_tokens=8192)
    assert stock - tiled == model.bytes_per_value * (n - 8192) * model.hidden
    no_sp = dataclasses.replace(layout, sp=False)
    assert other_term(model, no_sp, n, n, False, attn_tile_tokens=8192) == \
        other_term(model, no_sp, n, n, False)  # nothing gathered: nothing to tile


def test_estimate_reads_the_knob():
    model = load_model("paper-120b")
    layout = Layout(tp=2, cp=8, ep=16, sp=True)
    seq = 1 << 20
    flat = FlatConfig.preset("paper")
    without = estimate(model, layout, seq, flat)
    with_tiles = estimate(model, layout, seq, dataclasses.replace(flat, attn_tiles=8192))
    n = seq // layout.cp
    assert without.other - with_tiles.other == model.bytes_per_value * (n - 8192) * model.hidden
    assert with_tiles.dispatch == without.dispatch and with_tiles.vocab == without.vocab


# ------------------------------------------------------------------ fit, reach and costs
GPU, HOST = 141 << 30, 2 << 40


def test_the_default_tile_is_the_smallest_cheap_one_at_the_paper_presets():
    """ATTN_TILE_TOKENS: a power of two whose extra launches (and collective calls) and weight
    re-reads each stay under 10 % of its projection GEMMs at the paper's presets on their
    default layouts (TP 8), and half of it does not."""
    assert ATTN_TILE_TOKENS & (ATTN_TILE_TOKENS - 1) == 0
    for name, gpus in sorted(PAPER_GPUS.items()):
        model = load_model(name)
        layout = default_layout(model, gpus)
        cost = attn_tile_overhead(model, layout, ATTN_TILE_TOKENS)
        assert cost["launch"] < 0.1 and cost["reread"] < 0.1, (name, cost)
        half = attn_tile_overhead(model, layout, ATTN_TILE_TOKENS // 2)
        assert max(half["launch"], half["reread"]) >= 0.1, (name, half)


def test_tile_counts_charge_launches_calls_and_rereads_only():
    one = attn_tile_counts(projection_params=1000, tiles=1, bytes_per_value=2)
    assert one == {"ops": 0, "collective_calls": {}, "mem_bytes": 0}
    four = attn_tile_counts(projection_params=1000, tiles=4, bytes_per_value=2)
    assert four["ops"] == 3 * (2 * OPS_ATTN_TILE_FORWARD + OPS_ATTN_TILE_BACKWARD)
    assert four["collective_calls"] == {"all_gather_into_tensor": 3 * (2 * 1 + 2),
                                        "reduce_scatter_tensor": 3 * (2 * 1 + 1)}
    assert four["mem_bytes"] == 3 * (3 * 2 + 8) * 1000
    assert "flops" not in four  # every row is projected once per pass either way


def test_the_attention_unit_pays_for_the_tiles():
    model = load_model("paper-667b")
    layout = Layout(tp=8, cp=8, ep=32, sp=True)
    seq = 1 << 20
    flat = FlatConfig(optimizer_offload=True)
    tiled = dataclasses.replace(flat, attn_tiles=ATTN_TILE_TOKENS)
    plain = unit_costs(model, layout, estimate(model, layout, seq, flat), flat)["boundaries"][0]
    more = unit_costs(model, layout, estimate(model, layout, seq, tiled), tiled)["boundaries"][0]
    tiles = attn_tiles(layout, seq // layout.cp, tiled)
    assert tiles == -(-(seq // layout.cp // 8) // (ATTN_TILE_TOKENS // 8)) == 4
    layers = model.layers
    extra = attn_tile_counts(projection_params=model.attention_params_per_layer() // 8,
                             tiles=tiles, bytes_per_value=model.bytes_per_value)
    assert more["flops"] == plain["flops"]
    assert more["ops"] - plain.get("ops", 0) == layers * extra["ops"]
    assert more["mem_bytes"] - plain.get("mem_bytes", 0) == layers * extra["mem_bytes"]
    # No tiles without sequence parallelism over TP > 1.
    assert attn_tiles(Layout(tp=1, cp=8, ep=8), seq // 8, tiled) == 1
    assert attn_tiles(dataclasses.replace(layout, sp=False), seq // 8, tiled) == 1


def test_fit_turns_the_tiles_on_only_when_the_four_are_not_enough():
    model = load_model("paper-667b")
    layout = Layout(tp=8, cp=8, ep=32, sp=True)
    # 512K: the four suffice; 1M on this layout: they do not (903K without the tiles).
    assert not fit(model, layout, 1 << 19, GPU, HOST).flat.attn_tiles
    chosen = fit(model, layout, 1 << 20, GPU, HOST)
    assert chosen.enabled[-1] == "attn_tiles" and chosen.flat.attn_tiles >= ATTN_TILE_TOKENS
    untiled = [t for t in TECHNIQUES if t != "attn_tiles"]
    with pytest.raises(PlanError, match="does not fit"):
        fit(model, layout, 1 << 20, GPU, HOST, allow=untiled)
    # Relaxed toward fewer tiles while it fits: twice the tile does not fit any more.
    bigger = dataclasses.replace(chosen.flat, attn_tiles=2 * chosen.flat.attn_tiles)
    assert estimate(model, layout, 1 << 20, bigger).total > chosen.budget
    # Where they cannot run (TP 1), fit never turns them on.
    tp1 = Layout(tp=1, cp=64, ep=64)
    assert "attn_tiles" not in fit(model, tp1, 1 << 20, GPU, HOST).enabled


def test_both_reaches_at_a_layout():
    model = load_model("paper-667b")
    layout = Layout(tp=8, cp=8, ep=32, sp=True)
    reach = max_context(model, layout, GPU, HOST)
    untiled = [t for t in TECHNIQUES if t != "attn_tiles"]
    assert reach.flat_without_attn_tiles == max_context(model, layout, GPU, HOST,
                                                        allow=untiled).flat
    assert 0 < reach.flat_without_attn_tiles < reach.flat
    # Where the tiles do not apply, both are the same.
    tp1 = max_context(model, Layout(tp=1, cp=64, ep=64), GPU, HOST)
    assert tp1.flat_without_attn_tiles == tp1.flat
