"""benchmarks/vocab.py at P = 2 on tiny shapes: one record per (method, tokens) with every
key the issue names, and the facts its table must show — Ring-DTP's steady state makes no
host sync, its FLOPs are 4/3 of a dense projection + loss (the backward recomputes the
strip), MTP heads multiply FLOPs and ring bytes by 1 + D while Megatron's peak grows by a
saved softmax per head and Ring-DTP's stays near one head's."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

pytestmark = pytest.mark.world(2)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ("method", "P", "tokens", "peak_bytes", "strips", "syncs", "flops", "time_ms")
# Two token counts: below and above V/P = 64 (auto: activations, then weights).
TINY = ["--tokens", "48", "96", "--hidden", "16", "--vocab-per-rank", "64", "--reps", "1",
        "--dtype", "fp32", "--mtp-heads", "2"]


@pytest.fixture(scope="module")
def records(megatron_cpu):
    spec = importlib.util.spec_from_file_location(
        "vocab_benchmark", os.path.join(ROOT, "benchmarks", "vocab.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up by name
    spec.loader.exec_module(bench)
    return bench.run(bench.parse_args(TINY))


def test_one_record_per_method_and_tokens_with_every_key(records) -> None:
    methods = {"dense", "megatron-vp-ce", "megatron-vp-ce+mtp2", "ring-weights",
               "ring-activations", "ring-auto", "ring-auto-B/4", "ring-auto+mtp2"}
    assert sorted((r["method"], r["tokens"]) for r in records) == \
        sorted((m, n) for m in methods for n in (48, 96))
    for r in records:
        assert set(KEYS) <= set(r), set(KEYS) - set(r)
        assert r["P"] == 2 and r["peak_bytes"] > 0 and r["time_ms"] > 0
        assert r["strips"] == pytest.approx(r["peak_bytes"] / (r["tokens"] * 64 * 4))
    json.dumps(records)  # plain JSON


def test_ring_facts(records) -> None:
    by = {(r["method"], r["tokens"]): r for r in records}
    for n in (48, 96):
        dense, mega = by["dense", n], by["megatron-vp-ce", n]
        assert dense["flops"] == mega["flops"] == 3 * 2 * n * 16 * 128
        for name in ("ring-weights", "ring-activations", "ring-auto", "ring-auto-B/4"):
            r = by[name, n]
            assert r["syncs"] == 0, name  # steady state: the plan is kept
            assert 3 * r["flops"] == 4 * dense["flops"], name  # + the recomputed strip
            assert r["ring_bytes"] > 0 and r["ring_bytes_per_step"] == r["ring_bytes"] // 2
            assert r["peak_bytes"] < mega["peak_bytes"], name
        one, heads = by["ring-auto", n], by["ring-auto+mtp2", n]
        assert heads["syncs"] == 0
        assert heads["flops"] == 3 * one["flops"] and heads["ring_bytes"] == 3 * one["ring_bytes"]
        stock_heads = by["megatron-vp-ce+mtp2", n]
        # Megatron keeps each head's fp32 softmax to the backward: the peak grows per head;
        # Ring-DTP keeps each head's lse only.
        assert stock_heads["peak_bytes"] - mega["peak_bytes"] >= 2 * 4 * 2 * n * 64
        assert heads["peak_bytes"] - one["peak_bytes"] < 4 * 2 * n * 64
