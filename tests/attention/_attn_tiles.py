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


def assert_family_tiles_equal_stock(family: str, tp: int = 2, **overrides) -> dict:
    """A family's line (``testing.families``) at TP ``tp`` with sequence parallelism, built by
    Megatron-LM's builder without megatron-flat and with the flat spec and only
    ``--flat-attn-tiles`` on: the same model but the tiled modules (same parameters, same
    initial values), and one forward and backward give the same per-token losses and every
    gradient (fp32: the tiles reorder the weight gradients' sums). Returns how many modules
    of each tiled class the flat model has."""
    import contextlib

    import torch

    import megatron_flat
    from megatron_flat.config import FlatConfig
    from megatron_flat.cpu.grouped import te_grouped_experts
    from megatron_flat.megatron import install as inst
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.families import build_like_megatron_lm, family_args
    from megatron_flat.testing.families import FAMILIES, family_config, model_inventory
    from megatron_flat.testing.families import moe_loss_scale_kept
    from megatron_flat.testing.tiny_gpt import reset_mtp_tracker, reset_moe_loss_tracker

    # GPT-OSS's grouped experts with biases as its transformer-engine line builds them
    grouped = FAMILIES[family].fields.get("moe_grouped_gemm")
    results = []
    for spec in (None, ["megatron_flat.megatron.spec", "flat_gpt_layer_spec"]):
        inst._reset_for_tests()
        reset_moe_loss_tracker()
        reset_mtp_tracker()
        with megatron_layout(tp=tp, etp=1), moe_loss_scale_kept(), \
                (te_grouped_experts() if grouped else contextlib.nullcontext()):
            config = family_config(family, tp=tp, expert_tensor_parallel_size=1, **overrides)
            args = family_args(config, spec=spec)
            if spec is not None:
                megatron_flat.install(FlatConfig(attn_tiles=TILE), args)
            torch.manual_seed(0)
            model = build_like_megatron_lm(args, config, vocab_size=128, max_sequence_length=16)
            tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
            loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens)
            loss.sum().backward()
        results.append((model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    inst._reset_for_tests()
    (stock, stock_loss, stock_grads), (flat, flat_loss, flat_grads) = results
    assert model_inventory(flat)[0] == model_inventory(stock)[0]  # names, shapes, dtypes
    for (name, p), q in zip(flat.named_parameters(), stock.parameters()):
        assert torch.equal(p, q), name  # same seed, same initialisation order
    stock_classes = dict(model_inventory(stock)[1])
    tiled = {}
    for name, cls in model_inventory(flat)[1].items():
        if cls is not stock_classes[name]:
            assert issubclass(cls, stock_classes[name]), (name, stock_classes[name], cls)
            assert cls.__name__.startswith("Tiled") or cls.__name__ == "FlatMoELayer", name
            tiled[cls.__name__] = tiled.get(cls.__name__, 0) + 1
    # every tiled projection ran in tiles (16 tokens over TP 2: 8 rows, tiles of 3 rows)
    used = {name: m.most_tiles for name, m in flat.named_modules() if hasattr(m, "most_tiles")}
    assert used and min(used.values()) == max(used.values()) == 3, used
    torch.testing.assert_close(flat_loss, stock_loss, rtol=1e-5, atol=1e-6)
    assert flat_grads.keys() == stock_grads.keys()
    for name, grad in stock_grads.items():
        torch.testing.assert_close(flat_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    return tiled
