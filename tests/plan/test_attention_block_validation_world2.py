"""The planner's attention-block term against the memory meter at TP 2 with sequence
parallelism (2 ranks, gloo; ``_attention_block.py``): stock, with the attention tiles, and
with the tiles and Ring-DTP. The ``attention block`` section within 5% (the baseline terms'
target); Megatron's persistent gather buffer exactly: N × H for stock, still N × H with the
tiles alone (the stock output layer gathers through it), gone with Ring-DTP beside them."""


import pytest

from megatron_flat.config import FlatConfig

pytestmark = pytest.mark.world(2)

from tests.plan import _attention_block as block

TOLERANCE = 0.05
SHAPE = dict(seq_length=512, hidden_size=128, num_attention_heads=4, vocab_size=512)
TILE = 64  # tokens: 8 tiles of the 512
CASES = {
    "stock": None,
    "tiles": FlatConfig(attn_tiles=TILE),
    "tiles+ring-dtp": FlatConfig(attn_tiles=TILE, vocab=True, vocab_block_size=128),
}


@pytest.fixture(scope="module")
def table(megatron_cpu):
    tiny = block.tiny_model(**SHAPE)
    out = {name: block.rows(name, tiny, tp=2, flat=flat) for name, flat in CASES.items()}
    print("\n" + block.format_table([r for rows in out.values() for r in rows]))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_attention_block_matches_the_meter(table, name):
    (_, _, section, got), _ = table[name]
    assert got > 0 and abs(block.error(section, got)) <= TOLERANCE, \
        block.format_table(table[name])


def test_gather_buffer_is_what_the_planner_keeps(table):
    nh = 4 * SHAPE["seq_length"] * SHAPE["hidden_size"]
    held = {name: rows[1][3] for name, rows in table.items()}
    planned = {name: rows[1][2] for name, rows in table.items()}
    assert held == planned == {"stock": nh, "tiles": nh, "tiles+ring-dtp": 0}


def test_tiles_lower_the_block_by_the_projection_partial(table):
    # Stock's output projection holds its N × H partial sum before the reduce-scatter; the
    # tiled one a tile of it: the measured section falls by at least (N - 2·tile)·H·b.
    n, H = SHAPE["seq_length"], SHAPE["hidden_size"]
    stock, tiled = table["stock"][0][3], table["tiles"][0][3]
    assert stock - tiled >= 4 * (n - 2 * TILE) * H
