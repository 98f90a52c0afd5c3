"""LLEP / PipelinedLLEP over 2 and 4 ranks (gloo) against a dense single-process MoE.

Every rank rebuilds every rank's synthetic inputs from seeds and computes the global
reference, so outputs, token/router-probability gradients and each rank's expert-weight
gradients are checked without gathering. Tolerance (rtol 1e-5, atol 1e-7 on values up to
~0.1): fp32 rounding only — chunking changes GEMM row counts and the reduction order of
weight gradients, nothing else. With 4 ranks a hot expert spills to several helpers, one
helper serves several owners, and ranks differ in N.
"""

import pytest
import torch
import torch.distributed as dist

from megatron_flat.dispatch.experts import GLUExperts
from megatron_flat.dispatch.llep import DispatchOptions, PipelinedLLEP
from megatron_flat.testing.moe_reference import RankCase, engine_mismatches, sync_case
from tests._worlds import WORLDS, per_world

world2 = pytest.mark.world(2)
world4 = pytest.mark.world(4)

# The world-2 tests' shape (P ranks, E experts); world 4 has E4 experts, 2 per rank.
P = 2
E, H, F = 4, 8, 12
E4 = 8
EXPERTS = {2: E, 4: E4}

# name: (tokens per rank, topk, profile, options), per world size
SCENARIOS = {
    2: {
        "balanced-plain-ep": ([12, 12], 2, "balanced", dict(chunk_tokens=4)),
        "skew-llep-spills": ([16, 16], 2, "0.9/1", dict(chunk_tokens=4, imbalance_threshold=0.0)),
        "skew-contiguous": ([16, 16], 2, "0.9/1", dict(chunk_tokens=5, membership="contiguous",
                                                       imbalance_threshold=0.0)),
        "one-rank-receives-nothing": ([10, 10], 1, "1/1", dict(chunk_tokens=3,
                                                              imbalance_threshold=1e9)),
        "ragged-n-and-empty-rank": ([0, 13], 2, "0.7/2", dict(chunk_tokens=4,
                                                            imbalance_threshold=0.0)),
        "n-below-k": ([2, 7], 2, "0.8/1", dict(chunk_tokens=1, imbalance_threshold=0.0)),
        "k1": ([9, 5], 2, "0.8/1", dict(chunk_tokens=64, imbalance_threshold=0.0)),
        "unchunked-llep": ([11, 6], 2, "0.8/1", dict(mode="llep", imbalance_threshold=0.0)),
        # Chunk graphs kept from forward to backward: the first 2 of 4 chunks, and every chunk.
        "kept-chunks": ([16, 11], 2, "0.9/1", dict(chunk_tokens=4, imbalance_threshold=0.0,
                                                  saved_chunks=2)),
        "all-chunks-kept": ([12, 12], 2, "balanced", dict(chunk_tokens=4, saved_chunks=99)),
        # The CUDA schedule (next chunk's all-to-all in flight while this one computes) on gloo.
        "overlap": ([14, 9], 2, "0.9/1", dict(chunk_tokens=3, imbalance_threshold=0.0,
                                              overlap=True)),
    },
    4: {
        "balanced-plain-ep": ([8, 8, 8, 8], 2, "balanced", dict(chunk_tokens=3)),
        "skew-spills-to-many": ([12, 12, 12, 12], 2, "0.9/1", dict(chunk_tokens=4,
                                                                 imbalance_threshold=0.0)),
        "one-rank-gets-everything": ([6, 6, 6, 6], 1, "1/1", dict(chunk_tokens=2,
                                                                imbalance_threshold=1e9)),
        "ragged-n-below-k": ([1, 0, 9, 4], 2, "0.6/2", dict(chunk_tokens=1,
                                                          membership="contiguous",
                                                          imbalance_threshold=0.0)),
        "unchunked-llep": ([7, 10, 3, 8], 3, "0.5/1", dict(mode="llep", imbalance_threshold=0.0)),
    },
}

# World 4: the same hot expert on every rank (else rotated by rank).
SAME_ROUTING = {"skew-spills-to-many", "one-rank-gets-everything"}


@pytest.mark.parametrize("world, name", per_world(SCENARIOS))
def test_matches_dense_moe(world, name, dist_world):
    sizes, topk, profile, opts = SCENARIOS[world][name]
    rank = dist.get_rank()
    if world == 2:
        full = GLUExperts(E, H, F, generator=torch.Generator().manual_seed(11))
        cases = [RankCase(n, H, E, topk, profile, seed=100 + r, shift=r)
                 for r, n in enumerate(sizes)]
        options = DispatchOptions(min_tokens_per_gemm=1, **opts)
    else:
        full = GLUExperts(E4, H, F, generator=torch.Generator().manual_seed(12))
        shift = 0 if name in SAME_ROUTING else 1
        cases = [RankCase(n, H, E4, topk, profile, seed=200 + r, shift=shift * r)
                 for r, n in enumerate(sizes)]
        options = DispatchOptions(min_tokens_per_gemm=1, debug_checks=True, **opts)
    problems, stats = engine_mismatches(full, cases, rank, options=options, atol=1e-7)
    assert problems == []
    assert max(stats.received) <= stats.receive_bound
    if world == 2 and options.mode == "pipelined":
        assert stats.num_chunks == max(1, min(-(-max(sizes) // options.chunk_tokens), 10))
        assert stats.saved_chunks == min(options.saved_chunks, stats.num_chunks)
    if world == 2 and name.startswith("skew"):
        assert stats.llep and stats.plan.weight_transfers  # hot expert 0 spilled
    if name == "skew-spills-to-many":
        helpers = {h for e, _, h in stats.plan.weight_transfers if e == 0}
        assert len(helpers) >= 2
    if name == "one-rank-receives-nothing":
        assert not stats.llep
        assert (sum(stats.received) == 0) == (rank == 1)  # every route goes to expert 0
    if name == "one-rank-gets-everything":
        assert (sum(stats.received) == 0) == (rank != 0)


@world4
def test_helper_gemms_get_m_rows_per_chunk(dist_world):
    """The plan is made with each chunk's loads: every helper GEMM of every chunk gets at
    least m rows (m = 30, K = 4 strided chunks: a plan from the whole batch alone would cut
    its spill pieces four ways to about 20 rows), and the result equals the dense reference."""
    m = 30
    rank = dist.get_rank()
    full = GLUExperts(E4, H, F, generator=torch.Generator().manual_seed(12))
    cases = [RankCase(200, H, E4, 2, "0.6/1", seed=200 + r) for r in range(4)]
    options = DispatchOptions(chunk_tokens=50, imbalance_threshold=0.0, min_tokens_per_gemm=m,
                              debug_checks=True)
    problems, stats = engine_mismatches(full, cases, rank, options=options, atol=1e-7)
    assert problems == []
    assert stats.num_chunks == 4 and stats.plan.weight_transfers
    every = [None] * 4
    dist.all_gather_object(every, [n for chunk in stats.helper_rows for n in chunk])
    rows = [n for got in every for n in got]
    assert rows and min(rows) >= m, rows


class _GraphKeepingBank:
    """A bank without ``run_saving``: saved chunks save each expert's whole graph."""

    def __init__(self, bank):
        self.bank = bank
        self.num_local_experts = bank.num_local_experts
        self.local_weights, self.run = bank.local_weights, bank.run
        self.run_for_grad = bank.run_for_grad


def _run_engine(options, whole_graph=False):
    """One PipelinedLLEP forward + backward on this rank (skewed, spilling routes): the
    output, token and logit gradients and the local expert-weight gradients."""
    from megatron_flat.testing.moe_reference import local_bank_from

    rank = dist.get_rank()
    full = GLUExperts(E, H, F, generator=torch.Generator().manual_seed(5))
    bank = local_bank_from(full, rank * (E // P), E // P)
    saved_firsts = []
    keeping = bank.run_saving

    def run_saving(*args):  # count the first-layer outputs saved for backward
        out, first = keeping(*args)
        saved_firsts.append(first.shape[0])
        return out, first

    bank.run_saving = run_saving
    eng = PipelinedLLEP(_GraphKeepingBank(bank) if whole_graph else bank, num_experts=E,
                        topk=2, options=options)
    eng.saved_rows = saved_firsts
    b = RankCase(14 + 3 * rank, H, E, 2, "0.9/1", seed=40 + rank, shift=rank).build()
    out = eng(b["tokens"], b["route_token"], b["route_expert"], b["route_probs"])
    out.backward(b["grad"])
    weights = [w.grad for j in range(bank.num_local_experts) for w in bank.local_weights(j)]
    eng.last.saved_rows = sum(saved_firsts)
    return [out.detach(), b["tokens"].grad, b["logits"].grad] + weights, eng.last


@world2
@pytest.mark.parametrize("whole_graph", [False, True], ids=["first-layer", "whole-graph"])
@pytest.mark.parametrize("saved", [1, 3, 10])
def test_saved_chunks_are_bitwise_the_recomputed_ones(saved, whole_graph, dist_world):
    """Saving chunks (each expert's first-layer output, or with a bank that cannot hand it
    back its whole graph) changes where the backward's values come from, not the values:
    outputs and every gradient equal the all-recompute run bit for bit."""
    base = dict(chunk_tokens=4, imbalance_threshold=0.0, min_tokens_per_gemm=1)
    want, stats0 = _run_engine(DispatchOptions(**base), whole_graph)
    got, stats = _run_engine(DispatchOptions(saved_chunks=saved, **base), whole_graph)
    assert stats0.saved_chunks == 0 and stats.saved_chunks == min(saved, stats.num_chunks)
    # First-layer outputs were saved (for the received rows of the saved chunks) or not at all.
    saved_rows = sum(stats.received[:stats.saved_chunks])
    assert stats.saved_rows == (0 if whole_graph else saved_rows) and stats0.saved_rows == 0
    assert stats.num_chunks > 1 and stats.plan.weight_transfers  # helpers compute too
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@world2
def test_ranks_must_agree_on_settings(dist_world):
    rank = dist.get_rank()
    bank = GLUExperts(E // P, H, F)
    eng = PipelinedLLEP(bank, num_experts=E, topk=2,
                        options=DispatchOptions(chunk_tokens=4 + rank))
    b = RankCase(6, H, E, 2, seed=rank).build()
    with pytest.raises(ValueError, match=r"disagree on chunk_tokens \(\[4, 5\]\)"):
        eng(b["tokens"], b["route_token"], b["route_expert"], b["route_probs"])


@world2
def test_bad_input_fails_everywhere_before_a_collective(dist_world):
    """Every rank rejects the bad call locally; the group is still usable afterwards."""
    rank = dist.get_rank()
    full = GLUExperts(E, H, F, generator=torch.Generator().manual_seed(1))
    from megatron_flat.testing.moe_reference import local_bank_from

    bank = local_bank_from(full, rank * (E // P), E // P)
    eng = PipelinedLLEP(bank, num_experts=E, topk=2,
                        options=DispatchOptions(chunk_tokens=2, debug_checks=True))
    b = RankCase(5, H, E, 2, seed=rank).build()
    with pytest.raises(ValueError, match="inconsistent expert count"):
        eng(b["tokens"], b["route_token"], b["route_expert"] + E, b["route_probs"])
    out = eng(b["tokens"], b["route_token"], b["route_expert"], b["route_probs"])
    assert out.shape == (5, H) and eng.last.num_chunks == 3


@world2
def test_receive_bound_violation_raises_on_every_rank(dist_world, monkeypatch):
    """A receive-bound violation is a bug; every rank reports it (none is left waiting in
    the dispatch), naming the rank that would receive too much, and the group stays usable."""
    import megatron_flat.dispatch.llep as llep

    rank = dist.get_rank()
    full = GLUExperts(E, H, F, generator=torch.Generator().manual_seed(1))
    bank = llep_local_bank(full, rank)
    eng = PipelinedLLEP(bank, num_experts=E, topk=2,
                        options=DispatchOptions(chunk_tokens=4, debug_checks=True))
    # Rank 0's routes all go to expert 0 (native to rank 0); rank 1's spread out.
    b = RankCase(8, H, E, 2, "0.95/1" if rank == 0 else "balanced", seed=rank).build()
    args = (b["tokens"], b["route_token"], b["route_expert"], b["route_probs"])
    bound = {"value": 10**9}
    monkeypatch.setattr(llep, "receive_bound", lambda **kw: bound["value"])
    eng(*args)
    totals = [torch.tensor(max(eng.last.received)) for _ in range(P)]
    dist.all_gather(totals, torch.tensor(max(eng.last.received)))
    worst = max(range(P), key=lambda r: int(totals[r]))
    bound["value"] = int(totals[worst]) - 1  # exactly one rank (the worst) is over
    with pytest.raises(RuntimeError, match=f"PipelinedLLEP bug: rank {worst} would receive"):
        eng(*args)
    dist.barrier()


def llep_local_bank(full, rank):
    from megatron_flat.testing.moe_reference import local_bank_from

    return local_bank_from(full, rank * (E // P), E // P)


@world2
@pytest.mark.parametrize("extra", [dict(), dict(saved_chunks=2), dict(mode="llep")],
                         ids=["recomputed", "kept", "llep"])
def test_overlap_is_bitwise_the_serial_schedule(extra, dist_world, monkeypatch):
    """The CUDA schedule forced on over gloo's asynchronous work: the spilled-weight transfer
    in flight during the first dispatch, chunk i+1's dispatch during chunk i's experts, and
    chunk i's combine (backward: its input-gradient return) during chunk i+1's experts.
    Outputs and every gradient equal the one-at-a-time schedule bit for bit."""
    base = dict(chunk_tokens=4, imbalance_threshold=0.0, min_tokens_per_gemm=1, **extra)
    want, _ = _run_engine(DispatchOptions(overlap=False, **base))
    flags = []
    issue = dist.all_to_all_single

    def recording(*args, async_op=False, **kwargs):
        flags.append(async_op)
        return issue(*args, async_op=async_op, **kwargs)

    monkeypatch.setattr(dist, "all_to_all_single", recording)
    got, stats = _run_engine(DispatchOptions(overlap=True, **base))
    assert stats.plan.weight_transfers  # a helper computes: the transfer was in flight too
    # Every data all-to-all (weights, dispatch, return; forward and backward) in flight; only
    # the count exchange before the chunks waits at once.
    chunks = stats.num_chunks
    assert sum(flags) >= 4 * chunks + 1, (flags, chunks)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


class _NativeBank:
    """A bank that also runs its local experts in one call (``run_native*``), built from
    per-expert calls on each expert's rows, and counts its calls."""

    def __init__(self, bank):
        self.bank, self.calls = bank, {"native": 0, "expert": 0}
        self.num_local_experts, self.local_weights = bank.num_local_experts, bank.local_weights

    def _count(self, kind):
        self.calls[kind] += 1

    def run(self, *args):
        self._count("expert")
        return self.bank.run(*args)

    def run_for_grad(self, *args, **kwargs):
        self._count("expert")
        return self.bank.run_for_grad(*args, **kwargs)

    def run_saving(self, *args):
        self._count("expert")
        return self.bank.run_saving(*args)

    def _each(self, x, probs, counts, fn, firsts=None):
        self._count("native")
        parts = zip(range(len(counts)), torch.split(x, counts), torch.split(probs, counts),
                    torch.split(firsts, counts) if firsts is not None else [None] * len(counts))
        return [fn(self.local_weights(j), xj, pj, fj) for j, xj, pj, fj in parts if len(xj)]

    def run_native(self, x, probs, counts):
        return torch.cat(self._each(x, probs, counts, lambda w, xj, pj, fj: self.bank.run(
            w, xj, pj)))

    def run_native_saving(self, x, probs, counts):
        outs = self._each(x, probs, counts, lambda w, xj, pj, fj: self.bank.run_saving(
            w, xj, pj))
        return torch.cat([o for o, _ in outs]), torch.cat([f for _, f in outs])

    def run_native_for_grad(self, x, probs, counts, first=None):
        return torch.cat(self._each(x, probs, counts, lambda w, xj, pj, fj: self.bank.run_for_grad(
            w, xj, pj, first=fj), firsts=first))


class _PerExpert:
    """The same bank without its native calls."""

    def __init__(self, bank):
        self.num_local_experts, self.local_weights = bank.num_local_experts, bank.local_weights
        self.run, self.run_for_grad, self.run_saving = bank.run, bank.run_for_grad, \
            bank.run_saving


@world2
@pytest.mark.parametrize("extra", [dict(), dict(saved_chunks=2), dict(mode="llep")],
                         ids=["recomputed", "saved", "llep"])
def test_native_experts_run_in_one_call_per_chunk(extra, dist_world):
    """With a bank that runs its local experts in one grouped call, each chunk's native rows
    go through one call per pass (spilled experts' rows still one expert at a time), with
    outputs and every gradient bitwise those of the per-expert runs."""
    from megatron_flat.testing.moe_reference import local_bank_from

    rank = dist.get_rank()
    base = dict(chunk_tokens=4, imbalance_threshold=0.0, min_tokens_per_gemm=1,
                grouped_calls=True, **extra)
    results = []
    for native in (False, True):
        full = GLUExperts(E, H, F, generator=torch.Generator().manual_seed(5))
        bank = _NativeBank(local_bank_from(full, rank * (E // P), E // P))
        eng = PipelinedLLEP(bank if native else _PerExpert(bank), num_experts=E, topk=2,
                            options=DispatchOptions(**base))
        b = RankCase(14 + 3 * rank, H, E, 2, "0.9/1", seed=40 + rank, shift=rank).build()
        out = eng(b["tokens"], b["route_token"], b["route_expert"], b["route_probs"])
        out.backward(b["grad"])
        weights = [w.grad for j in range(bank.num_local_experts) for w in bank.local_weights(j)]
        results.append(([out.detach(), b["tokens"].grad, b["logits"].grad] + weights,
                        bank.calls, eng.last))
    (want, plain_calls, _), (got, calls, stats) = results
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert plain_calls["native"] == 0 and calls["native"] > 0
    # One native call per chunk with native rows, per pass (forward; backward unless llep).
    passes = 1 if extra.get("mode") == "llep" else 2
    assert calls["native"] <= passes * stats.num_chunks
    assert calls["expert"] < plain_calls["expert"]


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("profile", ["balanced", "0.9/1"], ids=["plain-ep", "spills"])
@pytest.mark.parametrize("world", WORLDS)
def test_one_host_sync_per_forward_call_none_in_backward(world, profile, recompute, dist_world):
    """With CUDA semantics (reads of device data, blocking uploads) a call waits once, for
    the route counts (the forward and, under full recompute, the checkpoint's re-run), and
    backward never, with and without spills."""
    got = sync_case(profile, recompute, experts=EXPERTS[world], hidden=H, ffn=F)
    assert got == {"forward": 2 if recompute else 1, "backward": 0, "chunks": 5,
                   "spills": profile != "balanced"}
