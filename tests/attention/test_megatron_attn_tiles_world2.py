"""``FlatConfig.attn_tiles`` in a Megatron training run against the same run without it
(2 ranks, gloo, TP 2 with sequence parallelism): per-step loss, step-0 gradients, parameters
after the last step and AdamW state, through Megatron-Core's GPT model with the tiled QKV and
output projections in every layer; alone, under full recompute, and with the other four
techniques on at TP 2 x EP 2."""

import dataclasses
import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.world(2)

_spec = importlib.util.spec_from_file_location(
    "_composed", pathlib.Path(__file__).parents[1] / "composed" / "_composed.py")
composed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(composed)

TILE = 6  # tokens a gathered tile: 3 rows of each rank's 8-row shard, a short last tile

LAYOUTS = {
    "tp2": (dict(tp=2), False),
    "tp2-full-recompute": (dict(tp=2, recompute="full"), False),
    "tp2-ep2-all-five": (dict(tp=2, ep=2, etp=1, recompute="full"), True),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_attention_tiles_equal_stock(megatron_cpu, name):
    import torch.distributed as dist

    from megatron_flat.config import FlatConfig
    from megatron_flat.megatron.attention_tiles import (
        TiledColumnParallelLinear,
        TiledRowParallelLinear,
    )
    from megatron_flat.testing.equivalence import ATOL, Layout, mismatches, run_layout
    from megatron_flat.testing.equivalence import run_reference
    from megatron_flat.testing.tiny_gpt import TinyMoE

    settings, all_five = LAYOUTS[name]
    layout = Layout(**settings)
    flat = (dataclasses.replace(composed.FLAT, attn_tiles=TILE) if all_five
            else FlatConfig(attn_tiles=TILE))
    tiny = TinyMoE()
    reference = run_reference(tiny, steps=1)
    stock = run_layout(tiny, layout, reference, steps=composed.STEPS)
    tiled = {}

    def inspect(trainer):
        tiled["qkv"] = sum(isinstance(m, TiledColumnParallelLinear) and m.tile_tokens == TILE
                           for m in trainer.model.modules())
        tiled["proj"] = sum(isinstance(m, TiledRowParallelLinear)
                            for m in trainer.model.modules())

    run = run_layout(tiny, layout, reference, steps=composed.STEPS, flat=flat, inspect=inspect)
    assert tiled["qkv"] == tiled["proj"] == tiny.num_layers, tiled
    problems = mismatches(run, stock)
    problems += composed.state_mismatches(run.optimizer_state, stock.optimizer_state, ATOL)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    found = sorted({p for rank in everyone for p in rank})
    assert not found, "attention tiles differ from stock:\n  " + "\n  ".join(found)
