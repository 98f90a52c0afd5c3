"""CostLedger over 2 and 4 ranks: collectives of known sizes, and benchmarks/ledger.py's
cheapest units at a tiny shape (every key, the structural facts stock vs flat must show, and
the per-layer formulas of ``megatron_flat.plan.costs`` equal to the counts). At both sizes the
flat MoE layer waits for the device no more often than Megatron's alltoall layer (once per
forward pass, never in backward), alone and under full recompute, with FLOPs and all-to-all
bytes under recompute at most stock's."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

from megatron_flat.plan.costs import moe_layer_counts, vocab_counts
from megatron_flat.runtime.ledger import CostLedger
from tests._worlds import WORLDS

world2 = pytest.mark.world(2)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Per world size: 4 experts top-2 (8 at 4 ranks: 2 per rank), 64 tokens per rank, chunk cap
# 16 (K = 4); at 2 ranks also the vocabulary unit: vocab 2 x 256, 32 tokens per rank.
MOE = ["--topk", "2", "--tokens", "64", "--hidden", "32", "--ffn", "32", "--chunk", "16"]
TINY = {
    2: ["--experts", "4", *MOE, "--vocab-tokens", "32", "--vocab-per-rank", "256",
        "--vocab-block", "64"],
    4: ["--experts", "8", *MOE],
}


def _bench():
    spec = importlib.util.spec_from_file_location(
        "ledger_benchmark", os.path.join(ROOT, "benchmarks", "ledger.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.fixture(scope="module")
def run(megatron_cpu):
    world = dist.get_world_size()
    bench = _bench()
    args = bench.parse_args(TINY[world])
    records = bench.unit_moe(args) + bench.unit_moe_recompute(args)
    if world == 2:
        records += bench.unit_vocab(args)
    return bench, args, {(r["unit"], r["variant"]): r for r in records}


@world2
def test_records_have_every_key(run) -> None:
    bench, _, by = run
    assert sorted(by) == sorted((u, v) for u in ("moe", "moe-recompute", "vocab")
                                for v in ("stock", "flat"))
    for r in by.values():
        assert set(bench.RECORD_KEYS) <= set(r), set(bench.RECORD_KEYS) - set(r)
        for key in ("flops", "all_to_all_bytes", "other_collective_bytes", "h2d_bytes",
                    "d2h_bytes", "syncs", "ops", "mem_bytes", "peak_device_bytes"):
            assert isinstance(r[key], int) and r[key] >= 0, (r["unit"], r["variant"], key)
        assert sum(r["sync_kinds"].values()) == r["syncs"]
        assert sum(r["collective_bytes"].values()) == \
            r["all_to_all_bytes"] + r["other_collective_bytes"]
        assert set(r["collective_calls"]) == set(r["collective_bytes"])
        assert isinstance(r["shape"], dict) and r["shape"]
        assert r["ops"] > 0 and r["flops"] > 0


@world2
def test_moe_flops_differ_only_by_the_chunk_recompute(run) -> None:
    _, args, by = run
    stock, flat = by[("moe", "stock")], by[("moe", "flat")]
    # Per routed token: stock fc1 (2 units) + fc2 (1) forward, twice that backward = 9;
    # PipelinedLLEP recomputes fc1 in backward, 2 more: at most 11/9 of stock.
    assert stock["flops"] <= flat["flops"] <= stock["flops"] * 11 / 9
    assert flat["flops"] > stock["flops"]
    # Both dispatch by all-to-all; PipelinedLLEP re-sends tokens with their gradients.
    assert 0 < stock["all_to_all_bytes"] < flat["all_to_all_bytes"]
    assert stock["stages"] == 1
    assert flat["stages"] == -(-args.tokens // args.chunk)  # K chunks
    assert flat["peak_device_bytes"] < stock["peak_device_bytes"]


@pytest.mark.parametrize("world", WORLDS)
def test_moe_under_full_recompute_does_no_more_than_stock(run, world) -> None:
    """Inside Megatron's full recompute the flat layer's re-run is graph-only (no dispatch,
    no expert GEMM): expert FLOPs and all-to-all bytes at most the stock layer's."""
    _, args, by = run
    stock, flat = by[("moe-recompute", "stock")], by[("moe-recompute", "flat")]
    assert flat["flops"] <= stock["flops"]
    assert flat["all_to_all_bytes"] <= stock["all_to_all_bytes"]
    # Without the graph-only re-run it would be more than stock: the formula's other branch.
    shape = flat["shape"]
    valued = moe_layer_counts(
        hidden=args.hidden, ffn=args.ffn, experts=args.experts, tokens=args.tokens,
        ep=shape["ep"], routes_computed=shape["routes_computed"],
        routes_sent=shape["routes_sent_off_rank"], bytes_per_value=4, flat=True,
        chunks=flat["stages"], recompute=True, graph_only=False, max_chunks=args.max_chunks)
    assert valued["flops"] > stock["flops"] and valued["all_to_all_bytes"] > \
        stock["all_to_all_bytes"]


@world2
def test_vocab_ring_moves_no_logits(run) -> None:
    _, args, by = run
    stock, flat = by[("vocab", "stock")], by[("vocab", "flat")]
    world = stock["shape"]["tp"]
    logits = args.vocab_tokens * world * args.vocab_per_rank * 4  # stock's [N, V/TP] fp32
    assert stock["peak_device_bytes"] >= logits
    assert flat["peak_device_bytes"] < logits
    assert flat["peak_device_bytes"] < stock["peak_device_bytes"]
    assert sum(flat["collective_bytes"].values()) > 0
    assert flat["all_to_all_bytes"] == 0
    assert flat["stages"] == world and stock["stages"] == 1
    # Same projection, forward and backward (Ring-DTP recomputes its strips: not fewer).
    assert flat["flops"] >= stock["flops"]


@world2
@pytest.mark.parametrize("unit", ["moe", "moe-recompute"])
@pytest.mark.parametrize("variant", ["stock", "flat"])
def test_moe_layer_formulas_equal_the_counts(run, unit, variant) -> None:
    _, args, by = run
    r = by[(unit, variant)]
    shape = r["shape"]
    want = moe_layer_counts(
        hidden=args.hidden, ffn=args.ffn, experts=args.experts, tokens=args.tokens,
        ep=shape["ep"], routes_computed=shape["routes_computed"],
        routes_sent=shape["routes_sent_off_rank"], bytes_per_value=4, gated=True,
        flat=variant == "flat", chunks=r["stages"], saved=0, recompute=unit == "moe-recompute",
        max_chunks=args.max_chunks, units=shape.get("units"))
    assert r["flops"] == want["flops"]
    assert r["all_to_all_bytes"] == want["all_to_all_bytes"]
    assert r["other_collective_bytes"] == want["other_collective_bytes"]
    assert r["collective_calls"] == want["collective_calls"]
    if variant == "flat":
        assert r["syncs"] == want["syncs"]
    else:  # 0.16.1: one wait + two masked_select per pass; 0.19 has no masked_select
        assert 1 <= r["syncs"] <= want["syncs"]
    assert abs(r["ops"] - want["ops"]) <= 0.15 * want["ops"]  # a fitted launch proxy


@world2
@pytest.mark.parametrize("variant", ["stock", "flat"])
def test_vocab_formulas_equal_the_counts(run, variant) -> None:
    _, args, by = run
    r = by[("vocab", variant)]
    shape = r["shape"]
    want = vocab_counts(hidden=shape["hidden"], vocab=shape["vocab"],
                        tokens=shape["tokens_per_rank"], tp=shape["tp"], bytes_per_value=4,
                        sequence_parallel=shape["sequence_parallel"], flat=variant == "flat",
                        mode="activations" if shape["tokens_per_rank"] <= shape["vocab_per_rank"]
                        else "weights")
    assert r["flops"] == want["flops"]
    if variant == "stock":
        assert r["other_collective_bytes"] == want["other_collective_bytes"]
        assert r["collective_calls"] == want["collective_calls"]
    else:  # the ring's sends; the all-gather of the ring plan is separate
        assert r["collective_bytes"]["send"] == want["other_collective_bytes"]
        assert r["collective_calls"]["send"] == want["collective_calls"]["send"]


@world2
def test_all_to_all_known_splits(dist_world) -> None:
    rank = dist.get_rank()
    # rank 0 sends 2 rows to itself and 3 to rank 1; rank 1 sends 1 to rank 0 and 4 to itself
    send = [[2, 3], [1, 4]][rank]
    recv = [[2, 1], [3, 4]][rank]
    x = torch.randn(sum(send), 6)
    out = torch.empty(sum(recv), 6)
    with CostLedger() as ledger:
        dist.all_to_all_single(out, x, recv, send)
    row = 6 * 4
    assert ledger.collective_bytes == {"all_to_all_single": [3, 1][rank] * row}
    assert ledger.collective_calls == {"all_to_all_single": 1}
    assert ledger.all_to_all_bytes == [3, 1][rank] * row
    assert ledger.other_collective_bytes == 0
    assert ledger.syncs == 0


@world2
def test_other_collectives_ring_bytes(dist_world) -> None:
    rank = dist.get_rank()
    x = torch.randn(8)  # 32 bytes
    with CostLedger() as ledger:
        with ledger.section("gather"):
            dist.all_gather_into_tensor(torch.empty(16), x)
        dist.reduce_scatter_tensor(torch.empty(4), x)
        dist.all_reduce(x)
        dist.broadcast(x, 0)
        peer = 1 - rank
        work = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.empty(8), peer)]
        )
        for w in work:
            w.wait()
    assert ledger.collective_bytes == {
        "all_gather_into_tensor": 32,
        "reduce_scatter_tensor": 16,
        "all_reduce": 32,
        "broadcast": 32,
        "send": 32,
        "recv": 0,
    }
    assert all(n == 1 for n in ledger.collective_calls.values())
    assert ledger.sections["gather"].collective_bytes == {"all_gather_into_tensor": 32}
    assert ledger.all_to_all_bytes == 0


@world2
def test_collective_output_is_device_data(dist_world) -> None:
    counts = torch.tensor([1, 2])
    counts.add_(torch.zeros(2, dtype=torch.long))  # pre-existing zeros: device data
    with CostLedger() as ledger:
        host = torch.tensor([5, 6])
        host.tolist()  # host plan: no sync
        got = torch.empty(2, dtype=torch.long)
        dist.all_to_all_single(got, counts)
        got.tolist()  # device data received: a sync
        row = torch.tensor([1, 2, 3])  # a host-built row, gathered as on a GPU (NCCL)
        table = torch.empty(6, dtype=torch.long)
        dist.all_gather_into_tensor(table, row)
        table.tolist()  # the gathered table sits in device memory there: a sync
    assert ledger.syncs == 2


@pytest.mark.parametrize("unit, passes", [("moe", 1), ("moe-recompute", 2)])
@pytest.mark.parametrize("world", WORLDS)
def test_flat_moe_waits_once_per_forward_pass(run, world, unit, passes) -> None:
    """PipelinedLLEP reads the device once per forward (every rank's route counts per
    chunk and expert: the plan and every split size follow from them) and never in
    backward; Megatron's alltoall dispatcher waits once per forward for its split sizes
    (plus two masked_select on 0.16). So the flat layer waits no more than stock on either
    release, alone and under full recompute (its graph-only re-run waits once too)."""
    _, _, by = run
    flat, stock = by[(unit, "flat")], by[(unit, "stock")]
    if world == 4:
        assert flat["stages"] == 4
    assert flat["sync_kinds"] == {"cpu": passes}
    assert stock["sync_kinds"].get("event_synchronize") == passes
    assert flat["syncs"] <= stock["syncs"]


@world2
def test_attention_replay_unit_saves_one_attention_forward_per_layer(megatron_cpu) -> None:
    bench = _bench()
    args = bench.parse_args(["--seq-length", "64"])
    records = {r["variant"]: r for r in bench.unit_attention_replay(args)}
    stock, flat = records["stock"], records["flat"]
    for r in records.values():
        assert set(bench.RECORD_KEYS) | {"layers", "peak_bytes"} <= set(r)
    shape = stock["shape"]
    layers = stock["layers"]
    microbatches = shape["global_batch"] // shape["micro_batch"] // dist.get_world_size()
    forwards = layers * microbatches
    assert stock["attention_forward_calls"] == 2 * forwards
    assert flat["attention_forward_calls"] == forwards
    assert stock["attention_backward_calls"] == flat["attention_backward_calls"] == forwards
    # the FLOPs of exactly those kernels: causal s x s per head, d = d_v = hidden / heads
    s, d = shape["seq"], shape["hidden"] // shape["heads"]
    per_call = 2 * shape["micro_batch"] * shape["heads"] * s * (s + 1) // 2 * (d + d)
    assert stock["flops"] - flat["flops"] == forwards * per_call
    # nothing else moves: the same collectives; the host traffic added is replay's own,
    # O (fp32 [s, b, hidden]) + LSE (fp32 [b, heads, s]) per layer and microbatch each way
    assert flat["collective_bytes"] == stock["collective_bytes"]
    pair = shape["micro_batch"] * s * (shape["hidden"] + shape["heads"]) * 4
    assert flat["replay_d2h_bytes"] == flat["replay_h2d_bytes"] == forwards * pair
    assert stock["replay_d2h_bytes"] == 0
    assert flat["d2h_bytes"] - stock["d2h_bytes"] == forwards * pair
    assert flat["h2d_bytes"] - stock["h2d_bytes"] == forwards * pair
