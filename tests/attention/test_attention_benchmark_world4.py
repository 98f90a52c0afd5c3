"""benchmarks/attention_tiles.py at TP 2 x CP 2 (4 ranks) on tiny shapes: each CP rank's TP
group gathers its N/CP tokens; the tiled block's peak holds no gathered (N/CP) × H (saved
against stock at every N, its slope in N smaller by at least that tensor's bytes per token),
and its collectives are four per tile."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.world(4)


def test_attention_tiles_benchmark_under_context_parallelism(tmp_path, monkeypatch,
                                                             benchmark_script, dist_world):
    import torch.distributed as dist

    bench = benchmark_script("attention_tiles")
    out = tmp_path / "attention.json"
    path = [str(out) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    hidden, cp, tp, rows = 32, 2, 2, 8
    destroy = dist.destroy_process_group

    def destroy_subgroups_only(group=None):  # the world is shared with the tests after this
        if group is not None and group is not dist.GroupMember.WORLD:
            destroy(group)

    monkeypatch.setattr(dist, "destroy_process_group", destroy_subgroups_only)
    monkeypatch.setattr(bench, "init_distributed", lambda: dist.get_world_size())
    bench.main(["--hidden", str(hidden), "--tokens", "256", "1024", "--tile-rows", str(rows),
                "--cp", str(cp), "--json", path[0]])
    dist.barrier()
    records = json.loads(open(path[0]).read())["records"]
    assert {(r["TP"], r["CP"]) for r in records} == {(tp, cp)}
    per_token = 4 * 2 * hidden / cp  # the gathered (N/CP) x H per token of N, fp32, mb 2
    stock = {r["tokens"]: r for r in records if r["variant"] == "stock"}
    tiled = {r["tokens"]: r for r in records if r["variant"] == "tiled"}
    assert sorted(stock) == sorted(tiled) == [256, 1024]
    for n, r in tiled.items():
        assert r["gathered_bytes"] == 4 * (n // cp) * 2 * hidden
        assert r["saved_bytes"] >= 0.9 * per_token * n, r
        assert r["collectives"] == 4 * r["tiles"] == 4 * (n // (cp * tp) // rows)
        assert stock[n]["collectives"] == 4
    assert tiled[1024]["slope_bytes_per_token"] <= \
        stock[1024]["slope_bytes_per_token"] - 0.9 * per_token
