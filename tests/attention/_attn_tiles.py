"""``FlatConfig.attn_tiles`` in a Megatron training run against the same run without it
(shared by the world-2 and world-4 files): per-step loss, step-0 gradients, parameters after
the last step and AdamW state, through Megatron-Core's GPT model with the tiled QKV and output
projections in every layer of the rank's stage, alone or with the other four techniques on."""

from __future__ import annotations

import dataclasses
from typing import Optional

from tests.composed import _composed as composed

TILE = 6  # tokens a gathered tile: 3 rows of each rank's 8-row shard, a short last tile


def assert_tiles_equal_stock(settings: dict, all_five: bool, model: Optional[dict] = None,
                             pp: int = 1) -> None:
    """Stock and tiled runs of ``Layout(**settings)`` agree on every rank (the harness's fp32
    tolerances: the tiles reorder the weight gradients' sums). ``pp``: the layers are split
    over that many stages, each rank's stage tiled in all its layers."""
    import torch.distributed as dist

    from megatron_flat.config import FlatConfig
    from megatron_flat.megatron.attention_tiles import (
        TiledColumnParallelLinear,
        TiledRowParallelLinear,
    )
    from megatron_flat.testing.equivalence import ATOL, Layout, mismatches, run_layout
    from megatron_flat.testing.equivalence import run_reference
    from megatron_flat.testing.tiny_gpt import TinyMoE

    layout = Layout(**settings)
    flat = (dataclasses.replace(composed.FLAT, attn_tiles=TILE) if all_five
            else FlatConfig(attn_tiles=TILE))
    tiny = TinyMoE(**(model or {}))
    reference = run_reference(tiny, steps=1)
    stock = run_layout(tiny, layout, reference, steps=composed.STEPS)
    tiled = {}

    def inspect(trainer):
        modules = [m for chunk in (trainer.model if isinstance(trainer.model, list)
                                   else [trainer.model]) for m in chunk.modules()]
        tiled["qkv"] = sum(isinstance(m, TiledColumnParallelLinear) and m.tile_tokens == TILE
                           for m in modules)
        tiled["proj"] = sum(isinstance(m, TiledRowParallelLinear) for m in modules)

    run = run_layout(tiny, layout, reference, steps=composed.STEPS, flat=flat, inspect=inspect)
    assert tiled["qkv"] == tiled["proj"] == tiny.num_layers // pp, tiled
    problems = mismatches(run, stock)
    problems += composed.state_mismatches(run.optimizer_state, stock.optimizer_state, ATOL)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    found = sorted({p for rank in everyone for p in rank})
    assert not found, "attention tiles differ from stock:\n  " + "\n  ".join(found)
