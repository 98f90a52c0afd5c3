"""benchmarks/dispatch.py at EP=2 on a tiny shape, sequential and grouped experts, alone and
inside Megatron's full recompute: one record per (profile, variant, grouped, recompute) with
the keys the issue names, and the facts the table must show (the recompute's extra forward
counted, the same all-to-all bytes for the same plan, the chunked peak below LLEP's)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

pytestmark = pytest.mark.world(2)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ("profile", "variant", "grouped", "recompute", "peak_bytes", "flops", "a2a_bytes",
        "syncs", "time_ms")
# Experts' weights large against the chunks' rows (4 local experts of 64 x 128), so a
# full-size gradient per expert would show in the peak.
TINY = ["--experts", "8", "--topk", "2", "--tokens", "64", "--chunk", "16", "--hidden", "64",
        "--ffn", "128", "--min-tokens-per-gemm", "4", "--profiles", "balanced", "0.8/2",
        "--reps", "1"]


@pytest.fixture(scope="module")
def bench(megatron_cpu):
    spec = importlib.util.spec_from_file_location(
        "dispatch_benchmark", os.path.join(ROOT, "benchmarks", "dispatch.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(bench):
    out = {}
    for grouped in (False, True):
        for recompute in (False, True):
            flags = (["--grouped"] if grouped else []) + (["--recompute"] if recompute else [])
            for r in bench.run(bench.parse_args(TINY + flags)):
                out[(r["profile"], r["variant"], r["grouped"], r["recompute"])] = r
    return out


def test_one_record_per_profile_variant_grouped_recompute(bench, rows) -> None:
    assert sorted(rows) == sorted((p, v, g, rc) for p in ("balanced", "0.8/2")
                                  for v in bench.VARIANTS for g in (False, True)
                                  for rc in (False, True))
    for r in rows.values():
        assert set(KEYS) <= set(r), set(KEYS) - set(r)
        assert r["peak_bytes"] > 0 and r["flops"] > 0 and r["time_ms"] > 0
        assert r["flops_vs_alltoall"] is not None


def test_counts_show_the_recompute_and_the_plan(bench, rows) -> None:
    for grouped in (False, True):
        for variant in ("alltoall", "llep", "pipelined-strided"):
            alone = rows[("balanced", variant, grouped, False)]
            again = rows[("balanced", variant, grouped, True)]
            if variant == "alltoall":
                # Full recompute runs the stock layer's forward once more: more FLOPs, bytes.
                assert again["flops"] > alone["flops"]
                assert again["a2a_bytes"] > alone["a2a_bytes"]
            else:
                # The flat layer's re-run is graph-only: its router runs again, its dispatch
                # moves nothing (route counts travel by all-reduce, not all-to-all), so the
                # chunked layer moves what it moves without recompute; unchunked LLEP, which
                # alone holds its graph, re-sends its tokens in backward instead.
                assert again["flops"] > alone["flops"]
                if variant == "llep":
                    assert again["a2a_bytes"] > alone["a2a_bytes"]
                else:
                    assert again["a2a_bytes"] == alone["a2a_bytes"]
                assert again["syncs"] == 2 * alone["syncs"] == 2
        # Under full recompute the flat layers do no more than stock: the re-run skips the
        # dispatch. (Counts are rank 0's: with skewed routing stock and LLEP load the ranks
        # differently, so only balanced routing compares rank for rank.)
        stock = rows[("balanced", "alltoall", grouped, True)]
        for variant in bench.VARIANTS[1:]:
            r = rows[("balanced", variant, grouped, True)]
            assert r["flops"] <= stock["flops"], variant
            assert r["a2a_bytes"] <= stock["a2a_bytes"], variant
        # Without recompute the chunked backward's fc1 again: at most 1.25x stock's FLOPs.
        for variant in bench.VARIANTS[1:]:
            r = rows[("balanced", variant, grouped, False)]
            assert r["flops"] <= 1.25 * rows[("balanced", "alltoall", grouped, False)]["flops"]
        # Sequential and grouped experts do the same work for the same plan: GroupedMLP
        # (0.16) and TEGroupedMLP (0.16, 0.19) have SequentialMLP's recompute shortcuts
        # (run_for_grad: fc2's forward GEMM skipped; run_saving: a saved chunk saves fc1's
        # output, which stands in for that GEMM in backward).
        for variant in bench.VARIANTS:
            seq, grp = (rows[("balanced", variant, g, False)] for g in (False, True))
            assert seq["flops"] == grp["flops"] and seq["a2a_bytes"] == grp["a2a_bytes"], variant
        # Grouped experts' weight gradients go into DDP's main_grad block by block, as
        # SequentialMLP's do: no fp32 gradient per expert is held to the end of backward.
        # What remains is DDP's placeholder gradient, which autograd stacks once for each
        # grouped weight: at most the local experts' weights (4 x (64 x 256 + 128 x 64) fp32).
        seq, grp = (rows[("balanced", "pipelined-strided", g, False)] for g in (False, True))
        experts_bytes = 4 * (64 * 256 + 128 * 64) * 4
        assert grp["peak_bytes"] <= seq["peak_bytes"] + experts_bytes, (grp["peak_bytes"],
                                                                        seq["peak_bytes"])
        # Chunks bound the dispatch peak below unchunked LLEP's.
        assert rows[("balanced", "pipelined-strided", grouped, False)]["peak_bytes"] < \
            rows[("balanced", "llep", grouped, False)]["peak_bytes"]
