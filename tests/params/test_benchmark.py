"""benchmarks/model_state.py runs end to end on a small stack and its JSON holds what the
issue asks for: per depth, with and without param offload, the device model state (flat in
depth with the offload, linear without), the step peak, the copies, syncs and bitwise."""

import json
import sys

import pytest


@pytest.mark.inline_copies  # memory measured with copies landing as issued
def test_model_state_benchmark_is_flat_in_depth_with_param_offload(
        tmp_path, monkeypatch, benchmark_script):
    bench = benchmark_script("model_state")
    out = tmp_path / "model_state.json"
    monkeypatch.setattr(sys, "argv", [
        "model_state.py", "--layers", "4", "8", "16", "--hidden", "16", "--ffn", "32",
        "--tokens", "32", "--json", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    keys = {"layers", "param_offload", "device_model_state_bytes", "step_peak_bytes",
            "h2d_bytes", "d2h_bytes", "syncs", "bitwise"}
    assert all(keys <= set(r) for r in rows) and len(rows) == 6
    assert all(r["bitwise"] for r in rows)
    on = {r["layers"]: r for r in rows if r["param_offload"]}
    off = {r["layers"]: r for r in rows if not r["param_offload"]}
    # without: weights (bf16) and fp32 main_grad of every layer, 6 B per parameter
    per_layer = off[4]["device_model_state_bytes"] // 4
    assert [off[n]["device_model_state_bytes"] for n in (4, 8, 16)] == [
        n * per_layer for n in (4, 8, 16)]
    # with: two layers' slots, whatever the depth (the issue's bound: within 5 %)
    assert len({on[n]["device_model_state_bytes"] for n in (4, 8, 16)}) == 1
    assert on[4]["device_model_state_bytes"] == 2 * per_layer
    for n in (4, 8, 16):
        assert off[n]["h2d_bytes"] == off[n]["d2h_bytes"] == off[n]["syncs"] == 0
        # two microbatches: each layer's fp32 gradient drained twice (4 B per parameter)
        assert on[n]["d2h_bytes"] == 2 * n * per_layer * 4 // 6
        assert on[n]["syncs"] == 1
