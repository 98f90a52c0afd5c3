"""The attention-tiles layer-spec transform: which linears it replaces, with what, and what it
refuses (single process; the transform only rewrites specs)."""

import dataclasses

import pytest

from megatron_flat.config import FlatConfig


def _local_spec(**kwargs):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, **kwargs)


def test_the_local_spec_gets_both_tiled_projections(megatron_cpu):
    from megatron_flat.megatron.attention_tiles import (
        TiledColumnParallelLinear,
        TiledRowParallelLinear,
    )
    from megatron_flat.megatron.spec import flat_layer_spec

    stock = _local_spec()
    tiled = flat_layer_spec(stock, FlatConfig(attn_tiles=2048))
    attention = tiled.submodules.self_attention.submodules
    assert attention.linear_qkv.module is TiledColumnParallelLinear
    assert attention.linear_proj.module is TiledRowParallelLinear
    assert attention.linear_qkv.params == attention.linear_proj.params == {"tile_tokens": 2048}
    # everything else is the stock spec's, and the stock spec is not mutated
    assert tiled.submodules.mlp == stock.submodules.mlp
    assert attention.core_attention == stock.submodules.self_attention.submodules.core_attention
    assert stock.submodules.self_attention.submodules.linear_qkv.__name__ == \
        "ColumnParallelLinear"
    assert flat_layer_spec(stock, FlatConfig()) is stock  # off: unchanged


def test_unknown_projections_and_multi_latent_attention_are_refused(megatron_cpu):
    from megatron_flat.megatron.attention_tiles import with_attn_tiles

    flat = FlatConfig(attn_tiles=64)
    stock = _local_spec()
    attention = stock.submodules.self_attention
    odd = dataclasses.replace(stock, submodules=dataclasses.replace(
        stock.submodules, self_attention=dataclasses.replace(
            attention, submodules=dataclasses.replace(attention.submodules,
                                                      linear_qkv=dict))))
    with pytest.raises(ValueError, match="this layer spec has 'dict'"):
        with_attn_tiles(odd, flat)
    with pytest.raises(ValueError, match="multi-latent attention is not tiled yet"):
        with_attn_tiles(_local_spec(multi_latent_attention=True), flat)


def test_the_tile_size_must_not_be_negative(megatron_cpu):
    from megatron.core.transformer.transformer_config import TransformerConfig
    import torch

    from megatron_flat.megatron.attention_tiles import TiledColumnParallelLinear
    from megatron_flat.testing.distributed import megatron_layout

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               use_cpu_initialization=True)
    with megatron_layout(tp=1):
        with pytest.raises(ValueError, match="tile_tokens must be >= 0"):
            TiledColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.zeros_,
                                      tile_tokens=-1)
