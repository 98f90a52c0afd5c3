"""benchmarks/attention_tiles.py at TP = 2 on tiny shapes: the tiled block's peak holds no
gathered N × H (saved against stock at every N, and its slope in N smaller by at least the
gathered tensor's bytes per token), and its collectives are four per tile."""

from __future__ import annotations

import json
import sys

import pytest

pytestmark = pytest.mark.world(2)


def test_attention_tiles_benchmark(tmp_path, monkeypatch, benchmark_script, dist_world):
    import torch.distributed as dist

    bench = benchmark_script("attention_tiles")
    out = tmp_path / "attention.json"
    path = [str(out) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    hidden = 32
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)  # shared world
    monkeypatch.setattr(bench, "init_distributed", lambda: dist.get_world_size())
    bench.main(["--hidden", str(hidden), "--tokens", "128", "512", "--tile-rows", "8",
                "--json", path[0]])
    dist.barrier()
    records = json.loads(open(path[0]).read())["records"]
    per_token = 4 * 2 * hidden  # the gathered N x H, fp32, micro-batch 2
    stock = {r["tokens"]: r for r in records if r["variant"] == "stock"}
    tiled = {r["tokens"]: r for r in records if r["variant"] == "tiled"}
    assert sorted(stock) == sorted(tiled) == [128, 512]
    for n, r in tiled.items():
        assert r["saved_bytes"] >= 0.9 * per_token * n, r
        assert r["collectives"] == 4 * r["tiles"] == 4 * (n // 2 // 8)
        assert stock[n]["collectives"] == 4
    assert tiled[512]["slope_bytes_per_token"] <= \
        stock[512]["slope_bytes_per_token"] - 0.9 * per_token
