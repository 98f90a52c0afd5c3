"""``FlatConfig.attn_tiles`` in a Megatron training run against the same run without it
(``_attn_tiles.py``), gloo.

2 ranks, TP 2 with sequence parallelism: alone, under full recompute, under module recompute,
and with the other four techniques on at TP 2 x EP 2. 4 ranks, full recompute: TP 2 x PP 2
(1F1B; each stage's layers tiled), TP 2 x CP 2 (each CP rank's sequence shard tiled over its
TP group), and TP 2 x CP 2 x EP 2 with the other four techniques on.
"""


import pytest

from tests._worlds import per_world
from tests.attention import _attn_tiles as tiles

# Under CP 2 x TP 2 a 32-token sequence leaves each rank 8 rows, as 16 tokens do at TP 2.
CP_MODEL = dict(seq_length=32)
# world size -> name: (settings, all five techniques on, model fields, pipeline stages)
LAYOUTS = {
    2: {
        "tp2": (dict(tp=2), False, None, 1),
        "tp2-full-recompute": (dict(tp=2, recompute="full"), False, None, 1),
        "tp2-module-recompute": (dict(tp=2, recompute="selective",
                                      recompute_modules=("core_attn",)), False, None, 1),
        "tp2-ep2-all-five": (dict(tp=2, ep=2, etp=1, recompute="full"), True, None, 1),
    },
    4: {
        "tp2-pp2": (dict(tp=2, pp=2, recompute="full"), False, None, 2),
        "tp2-cp2": (dict(tp=2, cp=2, recompute="full"), False, CP_MODEL, 1),
        "tp2-cp2-ep2-all-five": (dict(tp=2, cp=2, ep=2, etp=1, recompute="full"), True,
                                 CP_MODEL, 1),
    },
}


@pytest.mark.parametrize("world, name", per_world(LAYOUTS))
def test_attention_tiles_equal_stock(megatron_cpu, world, name):
    settings, all_five, model, pp = LAYOUTS[world][name]
    tiles.assert_tiles_equal_stock(settings, all_five, model=model, pp=pp)


# Family lines (testing.families) at TP 2 + SP, tiled alone -> (overrides, tiled modules per
# class in the 2-layer model): Qwen3's q/k RMSNorms and Llama-4's L2 norms act on the tiled
# QKV projection's output; Qwen2's and GPT-OSS's QKV biases are added per tile (GPT-OSS: also
# the output projection's bias, sinks and windows); DeepSeek-V3's MLA (and Kimi K2's) tiles
# its output projection, q and kv up projections and (local spec) its down projections;
# without a q LoRA, its q projection. DeepSeek-V3's MTP layer is tiled as well.
GQA = {"TiledColumnParallelLinear": 2, "TiledRowParallelLinear": 2}
FAMILY_TILES = {
    "qwen3_moe": ({}, GQA), "qwen2_moe": ({}, GQA), "mixtral": ({}, GQA), "llama4": ({}, GQA),
    "gpt_oss": ({}, GQA),
    "kimi_k2": ({}, {"TiledMLASelfAttention": 2, "TiledColumnParallelLinear": 8,
                     "TiledRowParallelLinear": 2}),
    "deepseek_v3": ({}, {"TiledMLASelfAttention": 3, "TiledColumnParallelLinear": 12,
                         "TiledRowParallelLinear": 3}),
    # (0.19's MLA refuses a q norm without a q LoRA unless the q projection fuses it)
    "deepseek_v3-no-q-lora": ({"q_lora_rank": None, "qk_layernorm": False},
                              {"TiledMLASelfAttention": 3, "TiledColumnParallelLinear": 9,
                               "TiledRowParallelLinear": 3}),
}


@pytest.mark.parametrize("world, name", per_world({2: FAMILY_TILES}))
def test_family_attention_tiles_equal_stock(megatron_cpu, world, name):
    overrides, counts = FAMILY_TILES[name]
    tiled = tiles.assert_family_tiles_equal_stock(name.split("-")[0], **overrides)
    tiled.pop("FlatMoELayer", None)
    assert tiled == counts
