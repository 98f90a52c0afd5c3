"""benchmarks/attention_tiles.py on tiny shapes at TP = 2 (2 ranks) and at TP 2 x CP 2 (4
ranks: each CP rank's TP group gathers its N/CP tokens): the tiled block's peak holds no
gathered (N/CP) × H (saved against stock at every N, and its slope in N smaller by at least
that tensor's bytes per token), and its collectives are four per tile."""

from __future__ import annotations

import json

import pytest

from tests._worlds import WORLDS

# world size -> (CP, the sequence lengths N)
SHAPES = {2: (1, [128, 512]), 4: (2, [256, 1024])}


@pytest.mark.parametrize("world", WORLDS)
def test_attention_tiles_benchmark(world, tmp_path, monkeypatch, benchmark_script, dist_world):
    import torch.distributed as dist

    bench = benchmark_script("attention_tiles")
    out = tmp_path / "attention.json"
    path = [str(out) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    (cp, lengths), hidden, tp, rows = SHAPES[world], 32, 2, 8
    destroy = dist.destroy_process_group

    def destroy_subgroups_only(group=None):  # the world is shared with the tests after this
        if group is not None and group is not dist.GroupMember.WORLD:
            destroy(group)

    monkeypatch.setattr(dist, "destroy_process_group", destroy_subgroups_only)
    monkeypatch.setattr(bench, "init_distributed", lambda: dist.get_world_size())
    bench.main(["--hidden", str(hidden), "--tokens", *map(str, lengths),
                "--tile-rows", str(rows), "--json", path[0]] + (["--cp", str(cp)] if cp > 1 else []))
    dist.barrier()
    records = json.loads(open(path[0]).read())["records"]
    assert {(r["TP"], r.get("CP", 1)) for r in records} == {(tp, cp)}
    per_token = 4 * 2 * hidden / cp  # the gathered (N/CP) x H per token of N, fp32, mb 2
    stock = {r["tokens"]: r for r in records if r["variant"] == "stock"}
    tiled = {r["tokens"]: r for r in records if r["variant"] == "tiled"}
    assert sorted(stock) == sorted(tiled) == lengths
    for n, r in tiled.items():
        if cp > 1:
            assert r["gathered_bytes"] == 4 * (n // cp) * 2 * hidden
        assert r["saved_bytes"] >= 0.9 * per_token * n, r
        assert r["collectives"] == 4 * r["tiles"] == 4 * (n // (cp * tp) // rows)
        assert stock[n]["collectives"] == 4
    longest = lengths[-1]
    assert tiled[longest]["slope_bytes_per_token"] <= \
        stock[longest]["slope_bytes_per_token"] - 0.9 * per_token
