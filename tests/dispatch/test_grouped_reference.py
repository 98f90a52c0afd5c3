"""Megatron's grouped experts on CPU (the CPU backend's grouped-GEMM reference): the stock
alltoall MoE layer with ``TEGroupedMLP`` (CPU grouped linears; 0.16 and 0.19) equals the
same layer with ``SequentialMLP`` bitwise — output, input, router and every expert weight
gradient — and with ``GroupedMLP`` (0.16) to fp32 rounding (its weights are stored
transposed, ``[H, 2F]`` blocks, so BLAS reads them another way; seen: 1e-9 on the input
gradient); on one rank here, at EP=2 in ``test_moe_worlds.py``. This is the reference the
flat layer's grouped experts are checked against."""


import pytest
import torch

from tests.dispatch import _moe_layers as helpers


@pytest.mark.parametrize("profile", ["balanced", "1/2", "0.7/1"])
@pytest.mark.parametrize("kind", helpers.GROUPED_KINDS)
def test_grouped_experts_equal_sequential_bitwise(megatron_cpu, kind, profile):
    from megatron_flat.dispatch.profiles import routing_profile
    from megatron_flat.megatron import compat
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    if helpers.grouped_experts_spec(kind) is None:
        assert kind == "grouped-mlp" and compat.grouped_mlp_class() is None
        pytest.skip(f"megatron-core {compat.version_text()} has no GroupedMLP "
                    "(TEGroupedMLP is tested)")
    tiny = TinyMoE()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2, tiny.hidden_size, generator=gen)
    g = torch.randn(6, 2, tiny.hidden_size, generator=gen)
    ids = routing_profile(profile, 12, tiny.num_experts, tiny.topk)
    with megatron_layout(seed=tiny.seed):
        sequential, grouped = helpers.build_grouped_pair(tiny, 1, kind)
        assert type(grouped.experts).__name__ == {"grouped-mlp": "GroupedMLP",
                                                  "te-grouped-mlp": "TEGroupedMLP"}[kind]
        exact = kind == "te-grouped-mlp"
        assert helpers.grouped_differences(sequential, grouped, x, g, ids, exact=exact) == []
        # The comparison sees a wrong weight: one element off by 1e-3.
        with torch.no_grad():
            compat.local_expert_weights(grouped.experts)[0][0][0, 0] += 1e-3
        assert helpers.grouped_differences(sequential, grouped, x, g, ids, exact=exact) != []


def test_reference_gmm_matches_a_dense_loop():
    from megatron_flat.cpu.grouped import gmm

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(7, 5, generator=gen, requires_grad=True)
    b = torch.randn(3, 5, 4, generator=gen, requires_grad=True)
    sizes = torch.tensor([2, 0, 5])
    out = gmm(a, b, sizes)
    want = torch.cat([a[:2] @ b[0], a[2:] @ b[2]])
    assert torch.equal(out, want)
    assert torch.equal(gmm(a, b.transpose(1, 2), sizes, trans_b=True), want)
    out.sum().backward()
    assert not b.grad[1].any() and b.grad[0].any()
    with pytest.raises(ValueError, match="batch_sizes"):
        gmm(a, b, torch.tensor([2, 2, 2]))


def test_grouped_reference_is_a_listed_patch_on_016(megatron_cpu):
    from megatron_flat.megatron import compat
    from megatron_flat.cpu.backend import applied_workarounds

    assert ("grouped_gemm reference" in applied_workarounds()) == (compat.grouped_mlp_class()
                                                               is not None)
