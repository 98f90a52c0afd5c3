"""benchmarks/dispatch_scale.py: one rank of a large EP group rehearsed in one process (the
stand-in group), scaled down to run in seconds. Its records hold the issue's keys and show
what must hold at any scale: one host sync per MoE forward call (two under full recompute),
none in backward, host planning memory O(P·K·E), every chunk within the receive bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_flat.runtime.memory import format_bytes

KEYS = ("ep", "experts", "topk", "tokens", "chunks", "hidden", "recompute", "syncs_forward",
        "syncs_backward", "host_plan_ms", "host_plan_bytes", "ops", "ops_predicted",
        "max_received", "receive_bound", "peak_bytes")
EP, E, K = 16, 64, 10


@pytest.mark.parametrize("recompute", [False, True])
def test_scale_rehearsal_records(tmp_path, recompute):
    out = tmp_path / "scale.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, os.path.join(root, "benchmarks", "dispatch_scale.py"),
           "--ep", str(EP), "--rank", "1", "--experts", str(E), "--topk", "4",
           "--tokens", "2048", "--chunk-tokens", "205", "--hidden", "16", "--ffn", "8",
           "--min-tokens-per-gemm", "64", "--reps", "2", "--json", str(out)]
    if recompute:
        cmd.append("--recompute")
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["profile"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"balanced", "0.3/16"}
    assert not rows["balanced"]["llep"] and rows["0.3/16"]["spills"] > 0
    for r in rows.values():
        assert all(k in r for k in KEYS), sorted(set(KEYS) - set(r))
        assert (r["ep"], r["experts"], r["chunks"], r["recompute"]) == (EP, E, K, recompute)
        assert r["syncs_forward"] == (2 if recompute else 1), r["sync_kinds"]
        assert r["syncs_backward"] == 0, r["sync_kinds"]
        assert 0 < r["max_received"] <= r["receive_bound"]
        # the counts' host copy ([P, K, E] int64) and a few tables of its size, no P² term
        assert r["host_plan_bytes"] <= 4 * EP * K * E * 8, format_bytes(r["host_plan_bytes"])
        assert r["host_plan_ms"] > 0 and r["peak_bytes"] > 0
        assert abs(r["ops"] - r["ops_predicted"]) <= 0.15 * r["ops_predicted"], r
