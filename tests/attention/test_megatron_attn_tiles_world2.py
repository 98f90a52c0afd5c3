"""``FlatConfig.attn_tiles`` in a Megatron training run against the same run without it
(2 ranks, gloo, TP 2 with sequence parallelism): alone, under full recompute, under module
recompute, and with the other four techniques on at TP 2 x EP 2 (``_attn_tiles.py``)."""


import pytest

pytestmark = pytest.mark.world(2)

from tests.attention import _attn_tiles as tiles

LAYOUTS = {
    "tp2": (dict(tp=2), False),
    "tp2-full-recompute": (dict(tp=2, recompute="full"), False),
    "tp2-module-recompute": (dict(tp=2, recompute="selective",
                                  recompute_modules=("core_attn",)), False),
    "tp2-ep2-all-five": (dict(tp=2, ep=2, etp=1, recompute="full"), True),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_attention_tiles_equal_stock(megatron_cpu, name):
    settings, all_five = LAYOUTS[name]
    tiles.assert_tiles_equal_stock(settings, all_five)
