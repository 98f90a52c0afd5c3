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


def test_unknown_projections_and_attentions_are_refused(megatron_cpu):
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
    # 0.19's FusedMLASelfAttention (--mla-down-proj-fusion): MLA's projections, one fused
    # down projection, which MLA accepts only as Megatron's own classes
    mla = _local_spec(multi_latent_attention=True)
    other = dataclasses.replace(mla, submodules=dataclasses.replace(
        mla.submodules, self_attention=dataclasses.replace(
            mla.submodules.self_attention, module=type("FusedMLASelfAttention", (), {}))))
    with pytest.raises(ValueError, match="this layer has 'FusedMLASelfAttention'"):
        with_attn_tiles(other, flat)


def test_multi_latent_attention_gets_its_gathering_projections_tiled(megatron_cpu, monkeypatch):
    """MLA's spec: the output projection and the up projections tiled in the spec, the
    attention TiledMLASelfAttention (it tiles the local spec's down projections once built);
    a transformer-engine up projection with a fused norm becomes MLA's own norm and a tiled
    projection, with the checkpoint keys mapped back to the fused layer's."""
    import sys
    import types

    from megatron_flat.megatron.attention_tiles import (
        TiledColumnParallelLinear,
        TiledMLASelfAttention,
        TiledRowParallelLinear,
        with_attn_tiles,
    )

    stock = _local_spec(multi_latent_attention=True)
    tiled = with_attn_tiles(stock, FlatConfig(attn_tiles=64))
    attention = tiled.submodules.self_attention
    assert attention.module is TiledMLASelfAttention and attention.params["tile_tokens"] == 64
    inner = attention.submodules
    for name in ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj"):
        assert getattr(inner, name).module is TiledColumnParallelLinear, name
    assert inner.linear_proj.module is TiledRowParallelLinear
    stock_inner = stock.submodules.self_attention.submodules
    # MLA checks its down projections by identity: they stay Megatron's in the spec
    assert inner.linear_q_down_proj is stock_inner.linear_q_down_proj
    assert inner.q_layernorm is stock_inner.q_layernorm
    te_up = type("TELayerNormColumnParallelLinear", (), {})
    te_norm = type("TENorm", (), {})
    monkeypatch.setitem(sys.modules, "megatron.core.extensions.transformer_engine",
                        types.SimpleNamespace(TENorm=te_norm))
    te_like = dataclasses.replace(stock, submodules=dataclasses.replace(
        stock.submodules, self_attention=dataclasses.replace(
            stock.submodules.self_attention, submodules=dataclasses.replace(
                stock_inner, linear_q_up_proj=te_up, linear_kv_up_proj=te_up))))
    tiled = with_attn_tiles(te_like, FlatConfig(attn_tiles=64))
    inner = tiled.submodules.self_attention.submodules
    assert inner.q_layernorm is te_norm and inner.kv_layernorm is te_norm
    assert inner.linear_q_up_proj.module is TiledColumnParallelLinear
    keys = tiled.submodules.sharded_state_dict_keys_map
    assert keys["self_attention.q_layernorm."] == "self_attention.linear_q_up_proj.layer_norm_"
    assert keys["self_attention.kv_layernorm."] == \
        "self_attention.linear_kv_up_proj.layer_norm_"


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
