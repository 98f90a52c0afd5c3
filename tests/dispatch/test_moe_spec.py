"""The flat MoE layer in Megatron specs, install() wiring, settings checks, and its EP=1
behaviour against the stock MoELayer (one process; multi-rank exactness is in *_world*.py)."""

import types

import pytest
import torch

from megatron_flat.config import FlatConfig

PIPELINED = FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=5, llep_min_tokens_per_gemm=1)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()  # tiny GEMMs: see tests/dispatch/test_llep.py
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_install():
    from megatron_flat.megatron import install as inst

    inst._reset_for_tests()
    yield inst
    inst._reset_for_tests()


def _mlp_module(layer_spec):
    from megatron_flat.megatron import compat

    return compat.moe_spec_module(layer_spec.submodules.mlp)


def test_layer_and_block_specs_use_the_flat_layer(megatron_cpu):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_flat.megatron.moe import FlatMoELayer
    from megatron_flat.megatron.spec import gpt_decoder_block_spec, gpt_layer_local_spec
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE, transformer_config

    assert _mlp_module(gpt_layer_local_spec(PIPELINED, num_experts=4)) is FlatMoELayer
    assert _mlp_module(gpt_layer_local_spec(FlatConfig(), num_experts=4)) is MoELayer
    dense = gpt_layer_local_spec(PIPELINED, num_experts=None)
    assert not issubclass(_mlp_module(dense) or object, MoELayer)
    config = transformer_config(TinyMoE())
    with megatron_layout():  # the block spec slices layers by pipeline stage
        block = gpt_decoder_block_spec(config, PIPELINED, normalization="RMSNorm")
    assert [_mlp_module(s) for s in block.layer_specs] == [FlatMoELayer] * config.num_layers


def test_stock_spec_functions_inside_flat_moe_specs(megatron_cpu):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_flat.megatron.moe import FlatMoELayer
    from megatron_flat.megatron.spec import flat_moe_specs

    with flat_moe_specs(PIPELINED):
        # the module attribute, looked up at call time as Megatron's own callers do
        import megatron.core.models.gpt.gpt_layer_specs as specs

        inside = specs.get_gpt_layer_local_spec(num_experts=4)
    assert _mlp_module(inside) is FlatMoELayer
    assert _mlp_module(get_gpt_layer_local_spec(num_experts=4)) is MoELayer
    assert _mlp_module(inside).__init__ is FlatMoELayer.__init__


def test_install_wires_dispatch_and_reset_unwires(megatron_cpu, fresh_install):
    import megatron.core.models.gpt.gpt_layer_specs as specs
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import megatron_flat
    from megatron_flat.megatron.moe import FlatMoELayer

    assert "dispatch" in fresh_install.WIRING
    megatron_flat.install(PIPELINED)
    assert _mlp_module(specs.get_gpt_layer_local_spec(num_experts=4)) is FlatMoELayer
    fresh_install._reset_for_tests()
    assert _mlp_module(specs.get_gpt_layer_local_spec(num_experts=4)) is MoELayer


def test_install_refuses_unsupported_moe_settings(megatron_cpu, fresh_install):
    import megatron_flat

    args = types.SimpleNamespace(num_experts=4, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=2, moe_grouped_gemm=True,
                                 moe_single_grouped_weight=True, add_bias_linear=True)
    with pytest.raises(fresh_install.FlatConfigError) as err:
        megatron_flat.install(PIPELINED, args)
    assert "expert_tensor_parallel_size=2" in str(err.value)
    assert "--moe-single-grouped-weight" in str(err.value)
    assert "bias" not in str(err.value)  # grouped experts with biases are supported
    assert fresh_install.installed() is None


def test_install_takes_grouped_gemm_experts(megatron_cpu, fresh_install):
    import megatron_flat

    args = types.SimpleNamespace(num_experts=4, expert_model_parallel_size=2,
                                 moe_grouped_gemm=True, add_bias_linear=False)
    assert megatron_flat.install(PIPELINED, args).dispatch == "pipelined"


def _layers(flat, **overrides):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    from megatron_flat.megatron import compat
    from megatron_flat.megatron.spec import flat_moe_spec
    from megatron_flat.testing.tiny_gpt import TinyMoE, transformer_config

    config = transformer_config(TinyMoE(), **overrides)
    spec = get_moe_module_spec_for_backend(backend=LocalSpecProvider(), num_experts=4)
    torch.manual_seed(3)
    stock = compat.build_moe_layer(spec, config)
    layer = compat.build_moe_layer(flat_moe_spec(spec, flat), config)
    layer.load_state_dict(stock.state_dict())
    return stock, layer


def test_unsupported_settings_fail_at_construction(megatron_cpu):
    from megatron_flat.megatron.moe import unsupported_settings
    from megatron_flat.testing.distributed import megatron_layout

    with megatron_layout():
        with pytest.raises(ValueError, match="moe_pad_expert_input_to_capacity"):
            _layers(PIPELINED, moe_expert_capacity_factor=1.0,
                    moe_pad_expert_input_to_capacity=True)
    found = unsupported_settings(types.SimpleNamespace(
        moe_pad_expert_input_to_capacity=True, fp8="hybrid", delay_wgrad_compute=True))
    assert len(found) == 3
    assert unsupported_settings(types.SimpleNamespace(moe_shared_expert_overlap=True)) == []


@pytest.mark.parametrize("flat, shared", [
    (FlatConfig(dispatch="llep"), False),
    (PIPELINED, False),
    (PIPELINED, True),
    (PIPELINED, "overlap"),  # --moe-shared-expert-overlap, the gate on: the shared stream
    (FlatConfig(), False),  # off: the stock forward
])
def test_single_rank_layer_matches_stock(flat, shared, megatron_cpu):
    from megatron_flat.testing.distributed import megatron_layout

    overrides = dict(moe_shared_expert_intermediate_size=32) if shared else {}
    if shared == "overlap":
        overrides.update(moe_shared_expert_overlap=True, moe_shared_expert_gate=True)
    with megatron_layout():
        stock, layer = _layers(flat, **overrides)
        assert (layer.flat_dispatch is None) == (flat.dispatch == "off")
        x = torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(1))
        g = torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(2))
        results = []
        for m in (stock, layer):
            xi = x.clone().requires_grad_()
            out, _ = m(xi)
            out.backward(g)
            results.append([out.detach(), xi.grad] + [p.grad for p in m.parameters()])
    exact = flat.dispatch in ("llep", "off")  # one chunk, EP=1: the experts see the same rows
    for a, b in zip(*results):
        if exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
