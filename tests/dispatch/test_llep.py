"""LLEP / PipelinedLLEP execution in one process (EP=1 still chunks): schedules, validation,
exactness against a dense MoE, and the chunked memory peak."""

import pytest
import torch

from megatron_flat.config import FlatConfig
from megatron_flat.dispatch.experts import GLUExperts, check_bank
from megatron_flat.dispatch.llep import DispatchOptions, PipelinedLLEP
from megatron_flat.dispatch.plan import llep_plan, plain_ep_plan
from megatron_flat.testing.moe_reference import RankCase, engine_mismatches
from megatron_flat.dispatch.schedule import (
    receive_schedule,
    routes_from_map,
    routes_from_topk,
    send_schedule,
    token_chunks,
    weight_schedule,
)
from megatron_flat.runtime.memory import MemoryMeter


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny GEMMs: one intra-op thread (OpenMP threads on a shared 2-core machine make a
    64x128 matmul ~100x slower when the other core is busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------- schedules
def test_routes_are_expert_major():
    ids = torch.tensor([[2, 0], [0, 1], [1, 2]])
    token, expert, flat = routes_from_topk(ids)
    assert expert.tolist() == [0, 0, 1, 1, 2, 2]
    assert token.tolist() == [0, 1, 1, 2, 0, 2]
    assert torch.equal(ids.reshape(-1)[flat], expert)
    routing_map = torch.zeros(3, 3, dtype=torch.bool)
    routing_map[token, expert] = True
    t2, e2 = routes_from_map(routing_map)
    assert torch.equal(t2, token) and torch.equal(e2, expert)
    with pytest.raises(ValueError, match="twice"):
        routes_from_topk(torch.tensor([[1, 1]]))


def test_send_and_receive_schedules_by_hand():
    # One source, P=2, E=4 (rank 0: experts 0,1; rank 1: experts 2,3), K=2 strided.
    ids = torch.tensor([[0, 2], [1, 3], [0, 3]])
    token, expert, _ = routes_from_topk(ids)          # expert-major
    dest = expert // 2
    chunks = token_chunks(3, 2, "strided")             # tokens 0,2 -> chunk 0; 1 -> chunk 1
    assert chunks.tolist() == [0, 1, 0]
    s = send_schedule(token, expert, dest, chunks, num_chunks=2, ep_size=2, num_experts=4)
    assert s.splits == [[2, 2], [1, 1]]
    sent = [list(zip(token[s.chunk(i)].tolist(), expert[s.chunk(i)].tolist())) for i in range(2)]
    assert sent[0] == [(0, 0), (2, 0), (0, 2), (2, 3)]  # by destination, expert-major inside
    assert sent[1] == [(1, 1), (1, 3)]
    assert s.counts.shape == (2, 2, 4)
    assert s.counts[0, 0].tolist() == [2, 0, 0, 0] and s.counts[1, 0].tolist() == [0, 0, 1, 1]
    # Restore gives expert-major order within the chunk.
    em = expert[s.chunk(0)][s.restore[0]]
    assert em.tolist() == sorted(em.tolist())
    # A receiver with counts from two sources groups by expert, then source.
    counts = torch.tensor([[[1, 2, 0, 0]], [[2, 0, 0, 0]]])  # [P_src=2, K=1, E=4]
    r = receive_schedule(counts)
    assert r.splits == [[3, 2]]
    assert r.segments == [[(0, 0, 3), (1, 3, 5)]]
    # received rows: src0 e0 (row 0), src0 e1 (rows 1-2), src1 e0 (rows 3-4)
    assert r.group[0].tolist() == [0, 3, 4, 1, 2]
    assert receive_schedule(torch.tensor([[[3, 1, 0, 0]]])).group == [None]  # identity


def test_weight_schedule_follows_the_plan():
    plan = llep_plan([10, 0, 0, 0], 2, min_tokens_per_gemm=1)  # cap 5: expert 0 spills to rank 1
    assert plan.weight_transfers == [(0, 0, 1)]
    assert weight_schedule(plan, 0).send == [[], [0]] and weight_schedule(plan, 0).recv == [[], []]
    assert weight_schedule(plan, 1).recv == [[0], []]
    assert weight_schedule(plain_ep_plan([10, 0, 0, 0], 2), 1).empty


# ---------------------------------------------------------------------------- validation
def test_options_are_validated():
    for kwargs, match in [(dict(chunk_tokens=0), "chunk_tokens"),
                          (dict(max_chunks=0), "max_chunks"),
                          (dict(mode="off"), "mode"), (dict(membership="random"), "membership"),
                          (dict(alpha=0.0), "alpha"), (dict(imbalance_threshold=-1), "imbalance"),
                          (dict(min_tokens_per_gemm=0), "min_tokens")]:
        with pytest.raises(ValueError, match=match):
            DispatchOptions(**kwargs)
    flat = FlatConfig(dispatch="pipelined", dispatch_chunk_tokens=7, dispatch_max_chunks=3,
                      dispatch_membership="contiguous", llep_alpha=1.5,
                      llep_min_tokens_per_gemm=2, llep_imbalance_threshold=0.0)
    assert DispatchOptions.from_flat_config(flat) == DispatchOptions(
        mode="pipelined", chunk_tokens=7, max_chunks=3, membership="contiguous", alpha=1.5,
        min_tokens_per_gemm=2, imbalance_threshold=0.0)
    with pytest.raises(ValueError, match="no flat dispatch"):
        DispatchOptions.from_flat_config(FlatConfig())


def test_bad_inputs_raise_before_any_collective():
    bank = GLUExperts(4, 8, 8)
    with pytest.raises(ValueError, match="inconsistent expert count"):
        PipelinedLLEP(bank, num_experts=8, topk=2)
    with pytest.raises(ValueError, match="topk"):
        PipelinedLLEP(bank, num_experts=4, topk=5)
    eng = PipelinedLLEP(bank, num_experts=4, topk=1,
                        options=DispatchOptions(debug_checks=True))
    fast = PipelinedLLEP(bank, num_experts=4, topk=1)  # checks that read device data off
    b = RankCase(6, 8, 4, 1, seed=1).build()
    args = (b["tokens"], b["route_token"], b["route_expert"], b["route_probs"])
    structural = [((b["tokens"][0],) + args[1:], "tokens"),
                  ((args[0], args[1], args[2], args[3][:-1]), "one entry per route"),
                  ((args[0], args[1], args[2].int(), args[3]), "int64")]
    values = [((args[0], args[1], args[2] + 4, args[3]), "inconsistent expert count"),
              ((args[0], args[1].flip(0), args[2], args[3]), "expert-major")]
    for call, match in structural + values:
        with pytest.raises(ValueError, match=match):
            eng(*call)
    for call, match in structural:  # shapes and dtypes cost no sync: always checked
        with pytest.raises(ValueError, match=match):
            fast(*call)
    two = RankCase(6, 8, 4, 2, seed=1).build()
    with pytest.raises(ValueError, match="more than topk"):
        eng(two["tokens"], two["route_token"], two["route_expert"], two["route_probs"])
    assert eng.last is None and fast.last is None
    with pytest.raises(ValueError, match="debug_checks must be a bool"):
        DispatchOptions(debug_checks=1)


def test_receive_bound_violation_is_reported_as_a_bug(monkeypatch):
    import megatron_flat.dispatch.llep as llep

    monkeypatch.setattr(llep, "receive_bound", lambda **kw: 3)  # pretend the bound were 3
    eng = PipelinedLLEP(GLUExperts(2, 8, 8), num_experts=2, topk=2,
                        options=DispatchOptions(chunk_tokens=4, debug_checks=True))
    b = RankCase(8, 8, 2, 2, seed=1).build()
    with pytest.raises(RuntimeError, match="PipelinedLLEP bug: rank 0 would receive 8 routes"):
        eng(b["tokens"], b["route_token"], b["route_expert"], b["route_probs"])


def test_bank_must_be_uniform():
    bank = GLUExperts(2, 8, 8)
    bank.fc2[1] = torch.nn.Parameter(torch.zeros(8, 4))
    with pytest.raises(ValueError, match="same weight shapes"):
        check_bank(bank, 2)


# ---------------------------------------------------------------------------- exactness
CASES = {
    "balanced-k3": dict(n=24, topk=2, profile="balanced", chunk=8),
    "skew": dict(n=30, topk=2, profile="0.9/1", chunk=4),
    "n-below-k": dict(n=3, topk=2, profile="balanced", chunk=1, max_chunks=10),
    "k1": dict(n=12, topk=2, profile="0.5/2", chunk=100),
    "empty": dict(n=0, topk=2, profile="balanced", chunk=4),
    "max-chunks-binds": dict(n=50, topk=3, profile="0.3/2", chunk=1, max_chunks=4),
}


@pytest.mark.parametrize("membership", ["strided", "contiguous"])
@pytest.mark.parametrize("mode", ["llep", "pipelined"])
@pytest.mark.parametrize("name", list(CASES))
def test_single_rank_matches_dense_moe(name, mode, membership):
    c = CASES[name]
    full = GLUExperts(4, 8, 12, generator=torch.Generator().manual_seed(7))
    case = RankCase(c["n"], 8, 4, c["topk"], c["profile"], seed=3)
    options = DispatchOptions(mode=mode, chunk_tokens=c["chunk"],
                              max_chunks=c.get("max_chunks", 10), membership=membership)
    # fp32 reordering on values below ~3e-2: atol 1e-5 of that scale
    problems, stats = engine_mismatches(full, [case], 0, options=options, atol=1e-7)
    assert problems == []
    n = c["n"]
    if mode == "pipelined":
        expect = max(1, min(-(-n // c["chunk"]), c.get("max_chunks", 10)))
        assert stats.num_chunks == expect
        assert stats.c_eff == -(-n // expect)
    else:
        assert stats.num_chunks == 1
    assert max(stats.received) <= stats.receive_bound


def test_weights_grads_flow_into_parameters_once():
    """Expert grads arrive as one accumulation per parameter (what DDP hooks count on)."""
    bank = GLUExperts(2, 8, 8, generator=torch.Generator().manual_seed(2))
    hooks = []
    for p in bank.parameters():
        p.register_post_accumulate_grad_hook(lambda p: hooks.append(p))
    eng = PipelinedLLEP(bank, num_experts=2, topk=1,
                        options=DispatchOptions(chunk_tokens=2))
    b = RankCase(9, 8, 2, 1, "0.5/1", seed=4).build()
    eng(b["tokens"], b["route_token"], b["route_expert"], b["route_probs"]).sum().backward()
    assert eng.last.num_chunks == 5
    assert len(hooks) == 4 and all(p.grad is not None for p in bank.parameters())


@pytest.mark.parametrize("mode", ["llep", "pipelined"])
def test_megatron_ddp_main_grad_protocol(mode):
    """Under Megatron's DDP (params with ``main_grad`` and ``grad_added_to_main_grad``), chunk
    gradients go straight into main_grad, the per-parameter hook still fires once and skips
    its add, and the result equals the plain path's gradients."""
    def bank_and_grads(ddp: bool):
        bank = GLUExperts(2, 8, 8, generator=torch.Generator().manual_seed(2))
        fired = []
        if ddp:
            for p in bank.parameters():
                p.main_grad = torch.zeros_like(p)
                p.grad_added_to_main_grad = False

                def hook(p):  # what Megatron DDP's backward post-hook does
                    fired.append(p)
                    if not p.grad_added_to_main_grad:
                        p.main_grad.add_(p.grad)
                    p.grad = None

                p.register_post_accumulate_grad_hook(hook)
        eng = PipelinedLLEP(bank, num_experts=2, topk=2,
                            options=DispatchOptions(mode=mode, chunk_tokens=3))
        b = RankCase(10, 8, 2, 2, "0.7/1", seed=4).build()
        eng(b["tokens"], b["route_token"], b["route_expert"], b["route_probs"]).backward(b["grad"])
        grads = [p.main_grad if ddp else p.grad for p in bank.parameters()]
        return bank, grads, fired

    bank, via_ddp, fired = bank_and_grads(True)
    _, plain, _ = bank_and_grads(False)
    assert len(fired) == 4 and all(p.grad is None for p in bank.parameters())
    # Both sum the chunks' gradients in chunk order from zero: bitwise.
    for a, b in zip(via_ddp, plain):
        assert torch.equal(a, b)


def test_no_grad_forward_matches():
    full = GLUExperts(2, 8, 8, generator=torch.Generator().manual_seed(2))
    b = RankCase(9, 8, 2, 2, seed=4).build(requires_grad=False)
    outs = []
    for mode in ("llep", "pipelined"):
        eng = PipelinedLLEP(full, num_experts=2, topk=2,
                            options=DispatchOptions(mode=mode, chunk_tokens=2))
        with torch.no_grad():
            outs.append(eng(b["tokens"], b["route_token"], b["route_expert"], b["route_probs"]))
    # fp32: the chunks change the GEMMs' row counts (outputs ~1e-4: atol scaled to them)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5,
                               atol=1e-5 * float(outs[1].abs().max()))


# ---------------------------------------------------------------------------- memory
def _run(mode: str, chunk: int, n: int = 480, hidden: int = 64, ffn: int = 64,
         topk: int = 4) -> None:
    bank = GLUExperts(8, hidden, ffn, generator=torch.Generator().manual_seed(0))
    b = RankCase(n, hidden, 8, topk, seed=1).build()
    eng = PipelinedLLEP(bank, num_experts=8, topk=topk,
                        options=DispatchOptions(mode=mode, chunk_tokens=chunk, max_chunks=10))
    for p in bank.parameters():
        p.grad = torch.zeros_like(p)
    return lambda: eng(b["tokens"], b["route_token"], b["route_expert"],
                       b["route_probs"]).backward(b["grad"])


def test_pipelined_peak_shrinks_with_chunks():
    """K=10 chunks: the routed working set is ~1/10; what stays is O(N·H) (output, input and
    output gradients) plus weight-gradient buffers, so the peak falls well below unchunked."""
    runs = {"unchunked": _run("llep", 480), "pipelined": _run("pipelined", 48),
            "one-chunk": _run("pipelined", 480)}
    with MemoryMeter("cpu") as meter:  # one meter (one heap scan), a section per variant
        for name, step in runs.items():
            with meter.section(name):
                step()
    peak = {name: meter.sections[name].peak_device_bytes for name in runs}
    assert peak["pipelined"] < 0.35 * peak["unchunked"], peak
    assert peak["pipelined"] < 0.4 * peak["one-chunk"], peak
