"""benchmarks/model_state_megatron.py at EP 2 on 2 ranks, small: every row holds what the
issue names, param offload is bitwise the run without it, and with it the device keeps only
the dense layers' growth with depth (the routed experts' state is two layers' slots)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.world(2)

KEYS = {"layers", "param_offload", "device_model_state_bytes", "host_model_state_bytes",
        "step_peak_bytes", "h2d_bytes", "d2h_bytes", "syncs", "bitwise", "model_state_ratio"}


def test_flat_megatron_rows(megatron_cpu, benchmark_script, tmp_path):
    bench = benchmark_script("model_state_megatron")
    out = tmp_path / "rows.json"
    rows = bench.main(["--layers", "3", "6", "--hidden", "32", "--ffn", "256", "--vocab",
                       "512", "--seq", "64", "--json", str(out)])
    assert len(rows) == 4 and all(set(r) == KEYS for r in rows)
    by = {(r["layers"], r["param_offload"]): r for r in rows}
    assert all(r["bitwise"] for r in rows)
    state = {k: r["device_model_state_bytes"] for k, r in by.items()}
    host = {k: r["host_model_state_bytes"] for k, r in by.items()}
    for n in (3, 6):
        assert state[n, True] < state[n, False]
        assert host[n, True] > host[n, False] > 0  # the experts' host tier beside the optimizer's
        # the fetches and drains are counted: more bytes both ways with the knob
        assert by[n, True]["h2d_bytes"] > by[n, False]["h2d_bytes"]
        assert by[n, True]["d2h_bytes"] > by[n, False]["d2h_bytes"]
    without = (state[6, False] - state[3, False]) // 3
    with_ = (state[6, True] - state[3, True]) // 3
    # Per added layer: the experts' weights and gradients without the knob; with it only the
    # layer's dense ones (attention, norms, router), under a tenth of a layer's state here
    # (the vocabulary is large enough that the dense shard fills OffloadStreamAdamW's bucket
    # at 3 layers already, so its staging does not grow with depth either).
    assert 0 < with_ * 10 < without
    # Host: every layer's experts' weights and fp32 gradients, linear in depth.
    assert (host[6, True] - host[6, False]) == 2 * (host[3, True] - host[3, False])
    assert out.exists() or bench.dist.get_rank() != 0
