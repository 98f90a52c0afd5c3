"""Planning with the chunks in mind (megatron_flat.dispatch.chunk_plan): one plan split over
K chunks, every rank's split sizes from the all-reduced counts alone, and at least m rows
per helper GEMM per chunk."""

from __future__ import annotations

import pytest
import torch

from megatron_flat.dispatch.chunk_plan import (
    chunk_flows,
    chunk_ranges,
    chunk_route_destinations,
    plan_rank,
)
from megatron_flat.dispatch.plan import (
    chunk_indices,
    llep_plan,
    plain_ep_plan,
    plan_dispatch,
    route_destinations,
)
from megatron_flat.dispatch.profiles import routing_profile
from megatron_flat.dispatch.schedule import routes_from_topk, token_chunks

P, E, TOPK = 4, 8, 2


def _ranks(n_per_rank, k, profile="0.7/2", membership="strided"):
    """Every rank's expert-major routes and their chunks; counts [P, K, E]."""
    ranks = []
    counts = torch.zeros(P, k, E, dtype=torch.long)
    for r, n in enumerate(n_per_rank):
        ids = routing_profile(profile, n, E, TOPK)
        token, expert, _ = routes_from_topk(ids)
        chunk = token_chunks(n, k, membership)[token]
        counts[r].view(-1).index_add_(0, chunk * E + expert, torch.ones_like(chunk))
        ranks.append((token, expert, chunk))
    return ranks, counts


def _plan(counts, m, chunked=True):
    loads = counts.sum((0, 1))
    chunk_loads = counts.sum(0).tolist()
    return llep_plan(loads, P, min_tokens_per_gemm=m,
                     chunk_loads=chunk_loads if chunked else None), chunk_loads


def test_one_chunk_is_the_plan_and_its_destinations():
    ranks, counts = _ranks([40, 40, 40, 40], 1)
    plan, chunk_loads = _plan(counts, m=4)
    assert plan.weight_transfers  # something spills
    ranges = chunk_ranges(plan, chunk_loads)
    assert ranges == [plan.assignments]
    for r, (token, expert, chunk) in enumerate(ranks):
        got = chunk_route_destinations(expert, chunk, counts, plan, ranges, r)
        want = route_destinations(expert.view(-1, 1), counts[:, 0], plan, r).view(-1)
        assert torch.equal(got, want)


@pytest.mark.parametrize("membership", ["strided", "contiguous"])
@pytest.mark.parametrize("profile", ["balanced", "0.7/2", "1/1"])
def test_flows_are_what_every_rank_sends(profile, membership):
    """The host-side flows (no exchange) equal what each rank's device-side destinations send,
    per (destination, chunk, expert); ranges tile each chunk's expert list."""
    ranks, counts = _ranks([37, 40, 29, 40], 4, profile, membership)
    plan = plan_dispatch(counts.sum((0, 1)), P, min_tokens_per_gemm=3, imbalance_threshold=0.0,
                         chunk_loads=counts.sum(0).tolist())
    ranges = chunk_ranges(plan, counts.sum(0).tolist())
    for i, row in enumerate(ranges):
        for e, rs in enumerate(row):
            cursor = 0
            for g, start, end in rs:
                assert start == cursor and end > start
                cursor = end
            assert cursor == int(counts[:, i, e].sum())
    flows = chunk_flows(plan, ranges, counts)
    assert torch.equal(flows.sum(1), counts)
    for r, (token, expert, chunk) in enumerate(ranks):
        dest = chunk_route_destinations(expert, chunk, counts, plan, ranges, r)
        sent = torch.zeros(P, 4, E, dtype=torch.long)
        sent.view(-1).index_add_(0, (dest * 4 + chunk) * E + expert, torch.ones_like(dest))
        assert torch.equal(sent, flows[r])


def test_every_helper_gemm_gets_m_rows_per_chunk():
    """Planned with the chunk loads, every spill piece's share in every chunk holds at least
    m rows (a piece that is an expert's whole remainder excepted, as for K = 1); planned
    from the whole batch alone, strided chunking cuts pieces K ways below m."""
    m, k = 30, 4
    ranks, counts = _ranks([200, 200, 200, 200], k, "0.6/1")

    def helper_rows(plan, chunk_loads):
        """(rows, whole remainder?) of every helper GEMM of every chunk."""
        out = []
        for row in chunk_ranges(plan, chunk_loads):
            for e, rs in enumerate(row):
                last = plan.assignments[e][-1][0] if plan.assignments[e] else None
                out += [(end - start, g == last) for g, start, end in rs if g != plan.owner(e)]
        return out

    plan, chunk_loads = _plan(counts, m)
    rows = helper_rows(plan, chunk_loads)
    assert plan.weight_transfers and rows
    assert all(n >= m for n, _ in rows), rows
    old, _ = _plan(counts, m, chunked=False)
    assert any(n < m for n, remainder in helper_rows(old, chunk_loads) if not remainder)


def test_plain_ep_flows_and_destinations_need_no_ranges_walk():
    ranks, counts = _ranks([16, 16, 16, 16], 2, "balanced")
    plan = plain_ep_plan(counts.sum((0, 1)), P)
    ranges = chunk_ranges(plan, counts.sum(0).tolist())
    flows = chunk_flows(plan, ranges, counts)
    owner = torch.arange(E) // (E // P)
    for d in range(P):
        assert torch.equal(flows[:, d], counts * (owner == d))
    token, expert, chunk = ranks[1]
    assert torch.equal(chunk_route_destinations(expert, chunk, counts, plan, ranges, 1),
                       expert // (E // P))


def test_chunk_loads_are_validated():
    with pytest.raises(ValueError, match="sum over the chunks"):
        llep_plan([4, 4], 2, chunk_loads=[[1, 1], [1, 1]])
    with pytest.raises(ValueError, match=r"\[K\]\[E\]"):
        llep_plan([4, 4], 2, chunk_loads=[[4], [4]])
    plan = llep_plan([4, 4], 2)
    with pytest.raises(ValueError, match="chunk_loads"):
        chunk_ranges(plan, [[1, 2]])


@pytest.mark.parametrize("profile", ["balanced", "0.7/2", "1/1"])
def test_a_rank_plans_only_its_own_row_and_column(profile):
    """plan_rank gives each rank its row of the flow table (send split sizes) and its column
    for the experts it computes (receive counts; nothing arrives for any other expert), the
    same plan on every rank, and tables whose destinations are the reference's."""
    k = 3
    ranks, counts = _ranks([37, 40, 29, 40], k, profile)
    flows = None
    for r, (token, expert, chunk) in enumerate(ranks):
        plan, share = plan_rank(counts, r, min_tokens_per_gemm=3, imbalance_threshold=0.0)
        if flows is None:
            first_plan = plan
            flows = chunk_flows(plan, share.ranges, counts)
        assert plan == first_plan
        assert share.send_splits == flows[r].sum(2).t().tolist()
        column = flows[:, r]                                    # [P_src, K, E]
        assert torch.equal(share.receive_counts, column[:, :, share.experts])
        others = [e for e in range(E) if e not in share.experts]
        assert int(column[:, :, others].sum()) == 0
        assert set(range(r * (E // P), (r + 1) * (E // P))) <= set(share.experts)
        got = chunk_route_destinations(expert, chunk, counts, plan, share.ranges, r)
        sent = torch.zeros(P, k, E, dtype=torch.long)
        sent.view(-1).index_add_(0, (got * k + chunk) * E + expert, torch.ones_like(got))
        assert torch.equal(sent, flows[r])


@pytest.mark.parametrize("membership", ["strided", "contiguous"])
@pytest.mark.parametrize("n, k", [(0, 3), (5, 10), (21, 10), (40, 4), (41, 4)])
def test_token_chunks_follow_chunk_indices(membership, n, k):
    """token_chunks (made from an arange where the tokens are) is chunk_indices' membership."""
    want = torch.full((n,), -1, dtype=torch.long)
    for i, idx in enumerate(chunk_indices(n, k, membership)):
        want[idx] = i
    assert torch.equal(token_chunks(n, k, membership), want)
