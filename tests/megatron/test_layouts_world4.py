"""Expert parallelism over 4 ranks agrees with the single-rank model (both dispatchers),
plus EP combined with TP and with PP."""

import pytest

pytestmark = pytest.mark.world(4)

LAYOUTS = {
    "ep4-alltoall": dict(ep=4),
    "ep4-allgather": dict(ep=4, dispatcher="allgather"),
    "tp2-ep2": dict(tp=2, ep=2),
    "pp2-ep2-recompute-full": dict(pp=2, ep=2, recompute="full"),
}


@pytest.fixture(scope="module")
def tiny():
    from megatron_flat.testing.tiny_gpt import TinyMoE

    return TinyMoE()


@pytest.fixture(scope="module")
def reference(megatron_cpu, tiny):
    from megatron_flat.testing.equivalence import run_reference

    return run_reference(tiny)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_rank(name, tiny, reference):
    from megatron_flat.testing.equivalence import Layout, assert_equivalent, run_layout

    result = run_layout(tiny, Layout(**LAYOUTS[name]), reference)
    assert_equivalent(result, reference)
    assert result.grads is not None
