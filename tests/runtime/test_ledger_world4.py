"""CostLedger at world size 4: the flat MoE layer waits for the device no more often than
Megatron's alltoall layer (once per forward pass, never in backward), alone and under full
recompute, with FLOPs and all-to-all bytes under recompute at most stock's."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = pytest.mark.world(4)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 8 experts top-2 (2 per rank), 64 tokens per rank, chunk cap 16 (K = 4).
TINY = ["--experts", "8", "--topk", "2", "--tokens", "64", "--hidden", "32", "--ffn", "32",
        "--chunk", "16"]


@pytest.fixture(scope="module")
def by(megatron_cpu):
    spec = importlib.util.spec_from_file_location(
        "ledger_benchmark_w4", os.path.join(ROOT, "benchmarks", "ledger.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(TINY)
    records = bench.unit_moe(args) + bench.unit_moe_recompute(args)
    return {(r["unit"], r["variant"]): r for r in records}


@pytest.mark.parametrize("unit, passes", [("moe", 1), ("moe-recompute", 2)])
def test_flat_waits_no_more_than_stock_at_ep4(by, unit, passes) -> None:
    flat, stock = by[(unit, "flat")], by[(unit, "stock")]
    assert flat["stages"] == 4
    assert flat["sync_kinds"] == {"cpu": passes}
    assert stock["sync_kinds"].get("event_synchronize") == passes
    assert flat["syncs"] <= stock["syncs"]


def test_flat_under_recompute_does_no_more_than_stock_at_ep4(by) -> None:
    flat, stock = by[("moe-recompute", "flat")], by[("moe-recompute", "stock")]
    assert flat["flops"] <= stock["flops"]
    assert flat["all_to_all_bytes"] <= stock["all_to_all_bytes"]
