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


def test_a_transformer_engine_qkv_keeps_its_fused_norm_as_the_layer_norm(megatron_cpu,
                                                                          monkeypatch):
    """transformer-engine's spec fuses the input norm into the QKV layer
    (``TELayerNormColumnParallelLinear``; the layer's ``input_layernorm`` is an identity). The
    transform puts the backend's norm back as ``input_layernorm`` and tiles a plain QKV
    projection after it. transformer-engine is not importable here, so its spec is stood in
    for by classes with its names and its extension module by one that holds ``TENorm``."""
    import sys
    import types

    from megatron_flat.megatron.attention_tiles import (
        TiledColumnParallelLinear,
        TiledRowParallelLinear,
        with_attn_tiles,
    )

    te_qkv = type("TELayerNormColumnParallelLinear", (), {})
    te_proj = type("TERowParallelLinear", (), {})
    te_norm = type("TENorm", (), {})
    monkeypatch.setitem(sys.modules, "megatron.core.extensions.transformer_engine",
                        types.SimpleNamespace(TENorm=te_norm))
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    stock = _local_spec()
    attention = stock.submodules.self_attention
    te_like = dataclasses.replace(stock, submodules=dataclasses.replace(
        stock.submodules, input_layernorm=IdentityOp,
        self_attention=dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, linear_qkv=ModuleSpec(module=te_qkv, params={"x": 1}),
            linear_proj=te_proj))))
    tiled = with_attn_tiles(te_like, FlatConfig(attn_tiles=512))
    assert tiled.submodules.input_layernorm is te_norm
    inner = tiled.submodules.self_attention.submodules
    assert inner.linear_qkv.module is TiledColumnParallelLinear
    assert inner.linear_qkv.params == {"x": 1, "tile_tokens": 512}  # the spec's own kept
    assert inner.linear_proj.module is TiledRowParallelLinear
    # a TE QKV layer without the fused norm leaves the layer's norm alone
    plain = dataclasses.replace(te_like, submodules=dataclasses.replace(
        te_like.submodules, self_attention=dataclasses.replace(
            te_like.submodules.self_attention, submodules=dataclasses.replace(
                te_like.submodules.self_attention.submodules,
                linear_qkv=type("TEColumnParallelLinear", (), {})))))
    assert with_attn_tiles(plain, FlatConfig(attn_tiles=512)).submodules.input_layernorm \
        is IdentityOp
