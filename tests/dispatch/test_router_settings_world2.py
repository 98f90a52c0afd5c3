"""The routers the MoE families train with, at EP 2 with chunking on: FlatMoELayer against
Megatron's stock alltoall MoELayer, each routing with its own router (no routing replay), so
the router's own settings decide the routes in both.

Settings (the DeepSeek-V3 / Kimi K2 / Llama-4 / Qwen2 lines): sigmoid scores, expert bias
(aux-loss-free balancing; its per-expert token counts must match too), group-limited routing,
the top-k scaling factor, ``seq_aux_loss``, shared experts with and without their gate and
with ``--moe-shared-expert-overlap`` (DeepSeek-R1 / Kimi K2 lines).
PipelinedLLEP runs 4-token chunks with LLEP forced on (every imbalance spills), so routes are
split into chunks and sent to helpers. Output, input gradient and every parameter gradient
(router, this rank's experts, shared experts) agree to fp32 rounding (``_moe_layers.RTOL``).
"""


import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.world(2)

from tests.dispatch import _moe_layers as helpers

P = 2
DEEPSEEK = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32")
ROUTERS = {
    "deepseek-group-limited": dict(DEEPSEEK, moe_router_num_groups=4, moe_router_group_topk=2,
                                   moe_router_load_balancing_type="seq_aux_loss",
                                   moe_aux_loss_coeff=1e-3,
                                   moe_shared_expert_intermediate_size=32,
                                   moe_shared_expert_overlap=True),
    "kimi-one-group": dict(DEEPSEEK, moe_router_load_balancing_type="none",
                           moe_aux_loss_coeff=0.0, moe_shared_expert_intermediate_size=32),
    "llama4-top1-sigmoid": dict(moe_router_score_function="sigmoid",
                                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                                moe_shared_expert_intermediate_size=64),
    "qwen2-gated-shared": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
                               moe_shared_expert_intermediate_size=64,
                               moe_shared_expert_gate=True),
}
TOPK = {"llama4-top1-sigmoid": 1}


def _layers(overrides, topk, flat):
    """(stock MoELayer, FlatMoELayer) with identical weights and router settings."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend

    from megatron_flat.megatron import compat
    from megatron_flat.megatron.spec import flat_moe_spec
    from megatron_flat.testing.tiny_gpt import TinyMoE, transformer_config

    tiny = TinyMoE(num_experts=8, topk=topk)
    config = transformer_config(tiny, ep=P, **overrides)
    spec = get_moe_module_spec_for_backend(backend=LocalSpecProvider(), num_experts=8)
    torch.manual_seed(11)
    stock = compat.build_moe_layer(spec, config)
    stock.set_layer_number(1)
    layer = compat.build_moe_layer(flat_moe_spec(spec, flat), config)
    layer.load_state_dict(stock.state_dict())
    layer.set_layer_number(1)
    if getattr(stock.router, "expert_bias", None) is not None:  # a trained, uneven bias
        bias = torch.linspace(-0.5, 0.5, 8)
        stock.router.expert_bias.copy_(bias)
        layer.router.expert_bias.copy_(bias)
    return tiny, stock, layer


@pytest.mark.parametrize("router", list(ROUTERS))
def test_router_settings_match_stock_at_ep2_chunked(router, megatron_cpu):
    from megatron_flat.config import FlatConfig
    from megatron_flat.testing.distributed import megatron_layout

    flat = FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=4, llep_min_tokens_per_gemm=1,
                      llep_imbalance_threshold=0.0)
    rank = dist.get_rank()
    with megatron_layout(ep=P):
        tiny, stock, layer = _layers(ROUTERS[router], TOPK.get(router, 2), flat)
        gen = torch.Generator().manual_seed(90 + rank)
        # Tokens skewed towards a few experts, so the plan spills and chunks.
        x = torch.randn(8, 2, tiny.hidden_size, generator=gen)
        x[:, :, :4] += 2.0
        g = torch.randn(8, 2, tiny.hidden_size, generator=gen)
        want = helpers.run(stock, x, g)  # each layer's own router decides
        got = helpers.run(layer, x, g)
        stats = layer.flat_dispatch.last
    assert stats.num_chunks == 4  # 16 tokens per rank, 4 a chunk
    assert helpers.differences(want, got, exact=False) == []
    if getattr(stock.router, "expert_bias", None) is not None:
        # Aux-loss-free balancing counts each expert's tokens for the bias update.
        assert torch.equal(stock.router.local_tokens_per_expert,
                           layer.router.local_tokens_per_expert)
    if ROUTERS[router].get("moe_shared_expert_intermediate_size"):
        assert any(n.startswith("shared_experts.") for n in got[2])
    # Every rank took part with the same settings.
    total = torch.tensor([stats.num_chunks], dtype=torch.int64)
    dist.all_reduce(total)
    assert total.item() == 4 * P
