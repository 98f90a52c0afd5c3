"""benchmarks/vocab.py at P = 2 on tiny shapes: one record per (method, P, tokens) with every
key the issue names, and the facts its table must show — Ring-DTP's steady state makes no
host sync, its FLOPs are 4/3 of a dense projection + loss (the backward recomputes the
strip), tiles keep the transient flat in N where whole strips grow, every method's errors
against fp64 sit at dense fp32's level and a rerun is bitwise equal, and MTP heads multiply
FLOPs and ring bytes by 1 + D while Megatron's peak grows by a saved softmax per head and
Ring-DTP's stays near one head's. The peers (Liger, Cut Cross-Entropy) run in Triton's
interpreter; bootstrap installs them for this test."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

# The peers' Triton kernels run in Triton's interpreter on CPU, which Triton picks when it is
# first imported (Megatron imports it): set before any test here imports Megatron.
os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.world(2)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ("method", "P", "tokens", "peak_bytes", "transient_bytes", "strips", "flops", "ops",
        "syncs", "err_loss", "err_dx", "err_dw", "bitwise_rerun", "time_ms")
V_P, H = 64, 16
TILE = 512  # bytes: 2 tokens of a 64-row fp32 strip
# Three token counts above V/P = 64 (auto: weights; the activations schedule circulates the
# tokens themselves, O(N) by design: the ring-activations row).
NS = (96, 160, 256)
TINY = ["--tokens", *map(str, NS), "--hidden", str(H), "--vocab-per-rank", str(V_P),
        "--reps", "1", "--dtype", "fp32", "--mtp-heads", "2", "--schedules",
        "--tile-bytes", str(TILE), "--cce-max-logits", str(256 * 2 * V_P)]
RING = ("ring", "ring-tiled", "ring-weights", "ring-activations", "ring-B/4")


@pytest.fixture(scope="module")
def records(megatron_cpu):
    missing = [m for m in ("triton", "liger_kernel", "cut_cross_entropy")
               if importlib.util.find_spec(m) is None]
    if missing:  # the rows are required: a missing peer is a broken environment, not a skip
        pytest.fail(f"benchmark peers not installed ({', '.join(missing)}): run "
                    "scripts/bootstrap.sh, which installs setup.py's bench-peers extra")
    spec = importlib.util.spec_from_file_location(
        "vocab_benchmark", os.path.join(ROOT, "benchmarks", "vocab.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up by name
    spec.loader.exec_module(bench)
    return bench.run(bench.parse_args(TINY))


def _by(records):
    return {(r["method"], r["tokens"]): r for r in records}


def test_one_record_per_method_and_tokens_with_every_key(records) -> None:
    methods = {"dense", "megatron", "liger", "cce", "megatron+mtp2", "ring-tiled+mtp2",
               *RING}
    assert sorted((r["method"], r["tokens"]) for r in records) == \
        sorted((m, n) for m in methods for n in NS)
    for r in records:
        assert set(KEYS) <= set(r), set(KEYS) - set(r)
        assert r["P"] == 2 and r["peak_bytes"] > 0
        assert r["strips"] == pytest.approx(r["peak_bytes"] / (r["tokens"] * V_P * 4))
        if r["method"] in ("liger", "cce"):  # Triton's interpreter: not timed on CPU
            assert r["time_ms"] is None
        else:
            assert r["time_ms"] > 0
    json.dumps(records)  # plain JSON


def test_ring_facts(records) -> None:
    by = _by(records)
    for n in NS:
        dense, mega = by["dense", n], by["megatron", n]
        assert dense["flops"] == mega["flops"] == 3 * 2 * n * H * 2 * V_P
        for name in RING:
            r = by[name, n]
            assert r["syncs"] == 0, name  # steady state: the plan is kept
            assert 3 * r["flops"] == 4 * dense["flops"], name  # + the recomputed strip
            assert r["ring_bytes"] > 0 and r["ring_bytes_per_step"] == r["ring_bytes"] // 2
        # Tiles move the same ring bytes, in more ops.
        assert by["ring-tiled", n]["ring_bytes"] == by["ring", n]["ring_bytes"]
        assert by["ring-tiled", n]["ops"] > by["ring", n]["ops"]
        one, heads = by["ring-tiled", n], by["ring-tiled+mtp2", n]
        assert heads["syncs"] == 0
        assert heads["flops"] == 3 * one["flops"] and heads["ring_bytes"] == 3 * one["ring_bytes"]
        stock_heads = by["megatron+mtp2", n]
        # Megatron keeps each head's fp32 softmax to the backward: the peak grows per head;
        # Ring-DTP keeps each head's lse only.
        assert stock_heads["peak_bytes"] - mega["peak_bytes"] >= 2 * 4 * 2 * n * V_P
        assert heads["peak_bytes"] - one["peak_bytes"] < 4 * 2 * n * V_P


def test_tiles_keep_the_transient_flat_where_strips_grow(records) -> None:
    by = _by(records)
    tiled = [by["ring-tiled", n]["transient_bytes"] for n in NS]
    whole = [by["ring", n]["transient_bytes"] for n in NS]
    assert max(tiled) <= 1.1 * min(tiled), tiled
    assert by["ring-tiled", NS[-1]]["transient_growth"] <= 1.1
    # Whole strips: at least the strip's 4·V/P bytes per token more.
    assert whole[2] - whole[0] >= 4 * V_P * (NS[-1] - NS[0]), whole
    assert by["ring", NS[0]]["transient_slope"] >= 4 * V_P
    assert tiled[2] < whole[2]


def test_errors_at_dense_fp32_level_and_bitwise_reruns(records) -> None:
    by = _by(records)
    for (name, n), r in by.items():
        assert r["bitwise_rerun"] is True, (name, n)
        if "+mtp" in name:  # no fp64 reference for the summed heads
            assert r["err_loss"] is None
            continue
        dense = by["dense", n]
        # Half inputs (cce runs fp16) are held to fp16's unit roundoff instead.
        level = 2.0**-10 if name == "cce" else max(
            4 * dense[k] for k in ("err_loss", "err_dx", "err_dw"))
        for k in ("err_loss", "err_dx", "err_dw"):
            assert 0 <= r[k] <= max(level, 1e-6), (name, n, k, r[k], level)
