"""The planner's attention term with sequence tiles (``FlatConfig.attn_tiles``): the gathered
N × H before the QKV projection becomes one gathered tile; nothing else moves."""

import dataclasses

import pytest

from megatron_flat.config import FlatConfig
from megatron_flat.plan.model import Layout, load_model
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
