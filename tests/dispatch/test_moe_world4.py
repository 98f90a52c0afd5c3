"""FlatMoELayer at EP=4 (gloo) against Megatron's alltoall dispatcher, and the tiny MoE GPT
at EP=4 and PP=2 x EP=2 through the equivalence harness (method and tolerances: see the
2-rank file and ``_moe_layers``)."""


import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.world(4)

from tests.dispatch import _moe_layers as helpers

P = 4


def flat(mode="pipelined", **kw):
    from megatron_flat.config import FlatConfig

    kw.setdefault("llep_min_tokens_per_gemm", 1)
    return FlatConfig(dispatch=mode, **kw)


# name: (topk, profile, seq length per rank, micro-batch, {variant: FlatConfig kwargs})
CASES = {
    "balanced": (2, "balanced", [4, 4, 4, 4], 2, {
        "llep-plain-ep": dict(mode="llep"),
        "pipelined": dict(dispatch_chunk_tokens=3),
    }),
    "heavy-skew": (2, "0.95/1", [6, 6, 6, 6], 2, {
        "llep": dict(mode="llep", llep_imbalance_threshold=0.0),
        "pipelined": dict(dispatch_chunk_tokens=4, llep_imbalance_threshold=0.0),
    }),
    "three-ranks-receive-nothing": (1, "1/1", [3, 3, 3, 3], 2, {
        "plain-ep": dict(dispatch_chunk_tokens=2, llep_imbalance_threshold=1e9),
    }),
    "ragged-n-below-k": (2, "0.6/2", [1, 2, 7, 4], 1, {
        "pipelined": dict(dispatch_chunk_tokens=1, dispatch_membership="contiguous",
                          llep_imbalance_threshold=0.0),
    }),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["balanced", "heavy-skew", "three-ranks-receive-nothing"])
@pytest.mark.parametrize("kind", helpers.GROUPED_KINDS)
def test_grouped_layer_matches_alltoall(kind, case, dtype, megatron_cpu):
    """FlatMoELayer with grouped-GEMM experts against the stock alltoall layer with the same
    experts at EP=4 (see ``_moe_layers.check_grouped_layer``)."""
    variants = CASES[case][4]
    helpers.check_grouped_layer(kind, CASES[case], dtype, P,
                                {n: flat(**kw) for n, kw in variants.items()})


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_alltoall(case, megatron_cpu):
    from megatron_flat.dispatch.profiles import routing_profile
    from megatron_flat.testing.distributed import megatron_layout
    from megatron_flat.testing.tiny_gpt import TinyMoE

    topk, profile, seqs, mb, variants = CASES[case]
    rank = dist.get_rank()
    tiny = TinyMoE(num_experts=2 * P, topk=topk)
    s = seqs[rank]
    gen = torch.Generator().manual_seed(70 + rank)
    x = torch.randn(s, mb, tiny.hidden_size, generator=gen)
    g = torch.randn(s, mb, tiny.hidden_size, generator=gen)
    ids = routing_profile(profile, s * mb, tiny.num_experts, topk)
    problems = {}
    with megatron_layout(ep=P):
        stock, layers = helpers.build_pair(tiny, P, {n: flat(**kw) for n, kw in variants.items()})
        want = helpers.run(stock, x, g, ids)
        for name, layer in layers.items():
            got = helpers.run(layer, x, g, ids)
            stats = layer.flat_dispatch.last
            exact = name.startswith("llep-plain-ep")
            problems[name] = helpers.differences(want, got, exact=exact)
            assert max(stats.received) <= stats.receive_bound
            if case == "heavy-skew":
                assert len({h for e, _, h in stats.plan.weight_transfers if e == 0}) >= 2
            if case == "three-ranks-receive-nothing":
                assert (sum(stats.received) == 0) == (rank != 0)
            if case == "ragged-n-below-k":
                assert stats.num_chunks == 7
    assert problems == {name: [] for name in variants}


@pytest.fixture(scope="module")
def tiny():
    from megatron_flat.testing.tiny_gpt import TinyMoE

    return TinyMoE(num_experts=8)


@pytest.fixture(scope="module")
def reference(megatron_cpu, tiny):
    from megatron_flat.testing.equivalence import run_reference

    return run_reference(tiny)


GPT_LAYOUTS = {
    "ep4-pipelined": (dict(ep=4), dict(dispatch_chunk_tokens=8, llep_imbalance_threshold=0.0)),
    "pp2-ep2-pipelined": (dict(pp=2, ep=2), dict(dispatch_chunk_tokens=8,
                                                 llep_imbalance_threshold=0.0)),
}


@pytest.mark.parametrize("name", list(GPT_LAYOUTS))
def test_gpt_step_matches_stock_model(name, tiny, reference):
    from megatron_flat.megatron.moe import FlatMoELayer
    from megatron_flat.megatron.spec import flat_moe_specs
    from megatron_flat.testing.equivalence import Layout, assert_equivalent, run_layout

    layout_kw, flat_kw = GPT_LAYOUTS[name]
    built = []

    def record(model):
        built.extend(m for m in model.modules() if isinstance(m, FlatMoELayer))
        return model

    with flat_moe_specs(flat(**flat_kw)):
        result = run_layout(tiny, Layout(**layout_kw), reference, wrap_model=record)
    assert len(built) == tiny.num_layers // layout_kw.get("pp", 1)
    assert_equivalent(result, reference)
    assert all(layer.flat_dispatch.last.num_chunks == 4 for layer in built)
