"""``FlatConfig.attn_tiles`` against the same run without it at 4 ranks, full recompute:
TP 2 x PP 2 (1F1B; each stage's layers tiled), TP 2 x CP 2 (each CP rank's sequence shard
tiled over its TP group), and TP 2 x CP 2 x EP 2 with the other four techniques on
(``_attn_tiles.py``)."""


import pytest

pytestmark = pytest.mark.world(4)

from tests.attention import _attn_tiles as tiles

# Under CP 2 x TP 2 a 32-token sequence leaves each rank 8 rows, as 16 tokens do at TP 2.
CP_MODEL = dict(seq_length=32)
LAYOUTS = {
    "tp2-pp2": (dict(tp=2, pp=2, recompute="full"), False, None, 2),
    "tp2-cp2": (dict(tp=2, cp=2, recompute="full"), False, CP_MODEL, 1),
    "tp2-cp2-ep2-all-five": (dict(tp=2, cp=2, ep=2, etp=1, recompute="full"), True, CP_MODEL, 1),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_attention_tiles_equal_stock(megatron_cpu, name):
    settings, all_five, model, pp = LAYOUTS[name]
    tiles.assert_tiles_equal_stock(settings, all_five, model=model, pp=pp)
