"""The attention block's projections under sequence parallelism: peak against N, sequence
tiles against stock (the whole sequence gathered at once), on this torchrun world as the TP
group, or as TP x CP with ``--cp`` (TP groups of consecutive ranks, as Megatron orders them;
each CP rank's TP group projects its N/CP tokens, which is all CP changes for the block).

One "block" per measurement, forward and backward, fp32, micro-batch 2: the QKV projection
(``tiled_gather_linear``: this rank's ``[N/TP, 2, H]`` shard to ``[N, 2, 3H/TP]``), its first
third standing in for the core attention's output, and the output projection
(``tiled_linear_reduce_scatter`` back to ``[N/TP, 2, H]``). *Stock* is the same ops with one
tile: the gathered N × H input and the N × H partial output exist, as in Megatron's
sequence-parallel linears. Peak = MemoryMeter device peak, worst rank. Reported per variant:
the peak at each N, *saved* = stock's peak − this one's (against one gathered N × H), and the
*slope* of the peak in N, bytes per token from the smallest to the largest N: stock's holds
the gathered N × H (4·2·H B per token more than the tiled one's, which holds only the N·H/TP
tensors); the tile size moves the tiled peak by a tile, not with N. Collectives per block:
``4·tiles`` (forward gather and reduce-scatter, backward re-gather, reduce-scatter and
gather) against stock's 4::

    torchrun --standalone --nproc-per-node 2 benchmarks/attention_tiles.py
    torchrun --standalone --nproc-per-node 4 benchmarks/attention_tiles.py --json out.json
    torchrun --standalone --nproc-per-node 4 benchmarks/attention_tiles.py --cp 2
"""

from __future__ import annotations

import argparse
import json
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron_flat.attention import SequenceTiles, tiled_gather_linear, tiled_linear_reduce_scatter
from megatron_flat.runtime import MemoryMeter
from megatron_flat.testing.distributed import init_distributed

F32, BATCH = 4, 2


def block_peak(n_local: int, hidden: int, rows: int, group) -> int:
    """Worst rank's device peak (bytes) of one block's forward + backward (the maximum over
    the whole world, every TP group included)."""
    tp = 1 if group is None else dist.get_world_size(group)
    gen = torch.Generator().manual_seed(n_local + dist.get_rank())
    x = torch.randn(n_local, BATCH, hidden, generator=gen).requires_grad_()
    w_qkv = torch.randn(3 * hidden // tp, hidden, generator=gen).requires_grad_()
    w_o = torch.randn(hidden, hidden // tp, generator=gen).requires_grad_()
    tiles = SequenceTiles(n_local, tp, rows)
    with MemoryMeter("cpu") as meter:
        qkv = tiled_gather_linear(x, w_qkv, tiles, group=group)
        out = tiled_linear_reduce_scatter(qkv[..., : hidden // tp], w_o, tiles, group=group)
        out.sum().backward()
    peak = torch.tensor([meter.peak_device_bytes], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def tp_group(tp: int):
    """This rank's TP group of ``tp`` consecutive ranks (every rank makes every group, in the
    same order, as ``new_group`` requires); None for TP 1."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp == 1:
        return None
    if tp == world:
        return dist.group.WORLD
    mine = None
    for first in range(0, world, tp):
        group = dist.new_group(list(range(first, first + tp)))
        if first <= rank < first + tp:
            mine = group
    return mine


def main(argv: List[str] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192],
                   help="sequence length N (all TP ranks together)")
    p.add_argument("--tile-rows", type=int, nargs="+", default=[16, 64],
                   help="rows per rank per tile (a gathered tile: TP x rows tokens)")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel size: the world is TP x CP, N split over CP first")
    p.add_argument("--json", default=None, help="write the records here")
    args = p.parse_args(argv)
    init_distributed()
    cp = args.cp
    if cp < 1 or dist.get_world_size() % cp:
        raise SystemExit(f"--cp {cp} must divide the world size {dist.get_world_size()}")
    tp = dist.get_world_size() // cp
    group = tp_group(tp)
    hidden = args.hidden
    if hidden % tp:
        raise SystemExit(f"--hidden {hidden} must divide by TP {tp}")
    records: List[Dict] = []
    for n in args.tokens:
        if n % (tp * cp):
            raise SystemExit(f"--tokens {n} must divide by TP x CP = {tp * cp}")
    variants = [("stock", None)] + [("tiled", rows) for rows in args.tile_rows]
    for n in args.tokens:
        n_local = n // (tp * cp)
        stock = block_peak(n_local, hidden, n_local, group)
        for variant, rows in variants:
            rows = rows or n_local
            tiles = SequenceTiles(n_local, tp, rows)
            peak = stock if variant == "stock" else block_peak(n_local, hidden, rows, group)
            records.append(dict(variant=variant, TP=tp, CP=cp, tokens=n, tile_rows=rows,
                                tiles=tiles.count, collectives=4 * tiles.count,
                                peak_bytes=peak, saved_bytes=stock - peak,
                                gathered_bytes=F32 * (n // cp) * BATCH * hidden,
                                tile_bytes=F32 * tiles.gathered_rows * BATCH * hidden))
    first, last = min(args.tokens), max(args.tokens)
    for r in records:
        same = [q for q in records if q["variant"] == r["variant"]
                and (q["variant"] == "stock" or q["tile_rows"] == r["tile_rows"])]
        lo = next(q for q in same if q["tokens"] == first)["peak_bytes"]
        hi = next(q for q in same if q["tokens"] == last)["peak_bytes"]
        r["slope_bytes_per_token"] = (hi - lo) / (last - first) if last > first else 0.0
    if dist.get_rank() == 0:
        print(f"TP={tp} CP={cp} H={hidden} micro-batch {BATCH}, fp32; gathered (N/CP) x H = "
              f"(N/{cp}) x {BATCH} x {hidden} x 4 B; slope from N={first} to N={last}")
        print(f"{'variant':8s} {'N':>7s} {'rows':>6s} {'tiles':>6s} {'colls':>6s} "
              f"{'peak':>11s} {'saved':>11s} {'gathered':>11s} {'slope B/tok':>11s}")
        for r in records:
            print(f"{r['variant']:8s} {r['tokens']:7d} {r['tile_rows']:6d} {r['tiles']:6d} "
                  f"{r['collectives']:6d} {r['peak_bytes']:11d} {r['saved_bytes']:11d} "
                  f"{r['gathered_bytes']:11d} {r['slope_bytes_per_token']:11.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"records": records}, f, indent=1)
    dist.barrier()
    if group is not None and group is not dist.group.WORLD:
        dist.destroy_process_group(group)  # (a caller sharing this process keeps its world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
