"""Megatron's sequence-parallel attention projections, stock and tiled, at TP 2 + SP on 2 gloo
ranks: the same parameters give the same outputs and gradients (weight gradients: fp32
reordering), through Megatron-Core's own layers and its sequence-parallel collectives."""

import pytest
import torch

pytestmark = pytest.mark.world(2)


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4,
                             tensor_model_parallel_size=2, sequence_parallel=True,
                             use_cpu_initialization=True, params_dtype=torch.float32,
                             gradient_accumulation_fusion=False, **overrides)


def _pair(stock_cls, tiled_cls, tile_tokens, **kwargs):
    init = torch.nn.init.normal_
    stock = stock_cls(16, 24, config=_config(), init_method=init, **kwargs)
    tiled = tiled_cls(16, 24, config=_config(), init_method=init, **kwargs)
    tiled.load_state_dict(stock.state_dict())
    tiled.tile_tokens = tile_tokens
    return stock, tiled


@pytest.mark.parametrize("tile_tokens", [4, 6, 64])
def test_qkv_projection(megatron_cpu, tile_tokens):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron_flat.megatron.attention_tiles import TiledColumnParallelLinear
    from megatron_flat.testing.distributed import megatron_layout

    with megatron_layout(tp=2):
        stock, tiled = _pair(ColumnParallelLinear, TiledColumnParallelLinear, tile_tokens,
                             bias=True, gather_output=False)
        rank = torch.distributed.get_rank()
        x = torch.randn(10, 2, 16, generator=torch.Generator().manual_seed(rank))
        grad = torch.randn(20, 2, 12, generator=torch.Generator().manual_seed(7 + rank))
        outs = []
        for layer in (stock, tiled):
            xi = x.clone().requires_grad_()
            y, bias = layer(xi)
            y.backward(grad)
            outs.append((y, bias, xi.grad, layer.weight.grad, layer.bias.grad))
        (y0, b0, dx0, dw0, db0), (y1, b1, dx1, dw1, db1) = outs
        assert y1.shape == (20, 2, 12) and b0 is None and b1 is None
        assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
        torch.testing.assert_close(dw1, dw0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(db1, db0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile_tokens", [4, 64])
def test_output_projection_with_main_grad(megatron_cpu, tile_tokens):
    """The tiles' weight gradients go into DDP's fp32 main_grad (Megatron's fused-accumulation
    convention: grad_added_to_main_grad set, a placeholder returned)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    from megatron_flat.megatron.attention_tiles import TiledRowParallelLinear
    from megatron_flat.testing.distributed import megatron_layout

    with megatron_layout(tp=2):
        stock, tiled = _pair(RowParallelLinear, TiledRowParallelLinear, tile_tokens,
                             bias=True, input_is_parallel=True, skip_bias_add=True)
        tiled.gradient_accumulation_fusion = True  # as on a GPU: into main_grad
        tiled.weight.main_grad = torch.zeros_like(tiled.weight)
        tiled.weight.grad_added_to_main_grad = False
        rank = torch.distributed.get_rank()
        z = torch.randn(20, 2, 8, generator=torch.Generator().manual_seed(rank))
        grad = torch.randn(10, 2, 24, generator=torch.Generator().manual_seed(3 + rank))
        results = []
        for layer in (stock, tiled):
            zi = z.clone().requires_grad_()
            y, bias = layer(zi)
            y.backward(grad)
            results.append((y, bias, zi.grad))
        (y0, b0, dz0), (y1, b1, dz1) = results
        assert torch.equal(y0, y1) and torch.equal(dz0, dz1) and b1 is tiled.bias
        assert tiled.weight.grad_added_to_main_grad
        torch.testing.assert_close(tiled.weight.main_grad, stock.weight.grad, rtol=1e-5,
                                   atol=1e-5)


def test_without_sequence_parallelism_the_layer_is_megatrons(megatron_cpu):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron_flat.megatron.attention_tiles import TiledColumnParallelLinear
    from megatron_flat.testing.distributed import megatron_layout

    with megatron_layout(tp=2):
        layer = TiledColumnParallelLinear(16, 24, config=_config(), init_method=torch.nn.init.normal_,
                                          bias=False, gather_output=False)
        layer.tile_tokens = 4
        layer.sequence_parallel = False
        x = torch.randn(10, 2, 16)
        assert torch.equal(layer(x)[0], ColumnParallelLinear.forward(layer, x)[0])
