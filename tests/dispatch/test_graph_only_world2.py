"""Graph-only recompute decided by the expert-parallel group (2 ranks, gloo).

Each rank reaches its own verdict on its own region; a call is graph-only only when every
rank wants it, agreed in the route-counts exchange. Regions that differ between ranks must
neither hang (a graph-only rank would skip the dispatch all-to-alls its peers wait in) nor
change a gradient; a violation found on one rank is raised on every rank with one message.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_flat.dispatch.experts import GLUExperts
from megatron_flat.dispatch.llep import DispatchOptions, PipelinedLLEP
from megatron_flat.testing.moe_reference import RankCase
from megatron_flat.testing.reentrant import Reentrant

pytestmark = pytest.mark.world(2)

E, H, F, TOPK = 4, 8, 8, 2

REGIONS = {
    # the MoE output reaches the region's end through value-free ops: graph-only is exact
    "residual": lambda moe: lambda x, p: x + moe(x, p),
    # a later op keeps a tensor computed from the output: values are needed
    "norm-after": lambda moe: lambda x, p: torch.nn.functional.layer_norm(
        x + moe(x, p), (x.shape[-1],)),
}


def _setup():
    rank = dist.get_rank()
    bank = GLUExperts(E // 2, H, F, generator=torch.Generator().manual_seed(20 + rank))
    eng = PipelinedLLEP(bank, num_experts=E, topk=TOPK,
                        options=DispatchOptions(chunk_tokens=3, min_tokens_per_gemm=1))
    case = RankCase(10, H, E, TOPK, "0.6/1", seed=40 + rank, shift=rank).build()
    return bank, eng, case


def _grads(bank, eng, case, region, checkpoint):
    for w in bank.parameters():
        w.grad = None
    x = case["tokens"].detach().requires_grad_()
    p = case["route_probs"].detach().requires_grad_()

    def moe(x, p):
        return eng(x, case["route_token"], case["route_expert"], p)

    fn = REGIONS[region](moe)
    out = Reentrant.apply(fn, x, p) if checkpoint else fn(x, p)
    out.backward(case["grad"])
    return [x.grad, p.grad] + [w.grad.clone() for w in bank.parameters()]


def test_regions_that_differ_between_ranks_compute_values_everywhere(dist_world):
    """Rank 0's region may skip its values, rank 1's may not: after the first re-run their
    verdicts differ; the group then computes values on both (no hang), gradients bitwise
    those of the layer without checkpointing, and rank 0 keeps the disagreement as reason."""
    rank = dist.get_rank()
    region = "residual" if rank == 0 else "norm-after"
    bank, eng, case = _setup()
    want = _grads(bank, eng, case, region, checkpoint=False)
    _grads(bank, eng, case, region, checkpoint=True)           # each rank verifies alone
    assert eng.verdict.graph_only is (rank == 0)
    for _ in range(2):
        got = _grads(bank, eng, case, region, checkpoint=True)
        assert not eng.last.graph_only
        for a, w in zip(got, want):
            assert torch.equal(a, w)
    assert eng.verdict.graph_only is False and eng.verdict.graph_only_calls == 0
    if rank == 0:
        assert "disagrees: graph-only on ranks [0], values on ranks [1]" in eng.verdict.reason


def test_agreed_graph_only_is_bitwise(dist_world):
    bank, eng, case = _setup()
    want = _grads(bank, eng, case, "residual", checkpoint=False)
    _grads(bank, eng, case, "residual", checkpoint=True)
    got = _grads(bank, eng, case, "residual", checkpoint=True)
    assert eng.last.graph_only and eng.verdict.graph_only_calls == 1
    for a, w in zip(got, want):
        assert torch.equal(a, w)


def test_a_violation_on_one_rank_is_raised_on_every_rank(dist_world):
    """Both ranks verified graph-only; then rank 1's region keeps the zeros. Rank 1 does not
    raise alone (rank 0 would wait in the next collective): the next call raises the same
    error on both, naming rank 1 and the tensor (rank 1 also names the op)."""
    rank = dist.get_rank()
    bank, eng, case = _setup()
    _grads(bank, eng, case, "residual", checkpoint=True)
    assert eng.verdict.graph_only is True
    region = "residual" if rank == 0 else "norm-after"
    _grads(bank, eng, case, region, checkpoint=True)           # graph-only on both
    assert eng.last.graph_only
    with pytest.raises(RuntimeError) as caught:
        _grads(bank, eng, case, "residual", checkpoint=True)
    message = str(caught.value)
    assert "returned zeros on rank 1" in message and f"a ({10}, {H}) tensor" in message
    assert ("Backward0 saved" in message) is (rank == 1)  # the autograd node: rank 1 only
    # the group goes on: the next call computes values (rank 1 dropped graph-only)
    _grads(bank, eng, case, "residual", checkpoint=True)
    assert not eng.last.graph_only
