"""Ring-DTP's backward peak at the paper's per-rank shape scaled down, in strips and in
shard-gradient units, with and without Megatron DDP's ``main_grad``.

The paper's per-rank shape has V/P = 3.5 H (H = 7168, V/P = 25,000); here H = ``--hidden``
and V/P = 3.5 H, fp32, at two token counts, below and above V/P (``auto`` moves activations,
then weights). Peak = MemoryMeter device peak of the backward above its entry, worst rank.
A strip is N x V/P fp32; a shard gradient (sg) V/P x H fp32. With ``main_grad`` the
shard's gradient accumulates in place there (the buffer exists before, as DDP's does), so
the target is 3 strips + 1 sg; without it the fresh fp32 shard gradient comes on top::

    torchrun --standalone --nproc-per-node 4 benchmarks/vocab_backward.py
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from megatron_flat.runtime import MemoryMeter
from megatron_flat.testing.distributed import init_distributed
from megatron_flat.vocab import ring_dtp_cross_entropy


def backward_peak(group, mode: str, n: int, rows: int, hidden: int, main_grad: bool) -> int:
    """This rank's backward peak (bytes) of one Ring-DTP call, worst rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(12 + rank)
    x = torch.randn(n, hidden, generator=gen).requires_grad_()
    w = torch.nn.Parameter(torch.randn(rows, hidden, generator=gen))
    if main_grad:
        w.main_grad = torch.zeros_like(w)  # DDP's buffer: allocated before the step
        w.grad_added_to_main_grad = False
    labels = torch.randint(0, rows * world, (n,), generator=gen)
    loss = ring_dtp_cross_entropy(x, w, labels, group=group, mode=mode)
    with MemoryMeter("cpu") as meter:
        loss.sum().backward()
    peak = torch.tensor([meter.peak_device_bytes], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens per rank (default: V/P / 1.75 and 2.3 V/P)")
    args = p.parse_args()
    init_distributed()
    world = dist.get_world_size()
    group = dist.group.WORLD if world > 1 else None
    hidden, rows = args.hidden, int(3.5 * args.hidden)
    tokens = args.tokens or [int(rows / 1.75), int(2.3 * rows)]
    if dist.get_rank() == 0:
        print(f"P={world} H={hidden} V/P={rows} fp32; strip = N x V/P x 4, "
              f"sg = V/P x H x 4 = {rows * hidden * 4} B")
        print(f"{'N':>6s} {'mode':12s} {'main_grad':>9s} {'strips':>7s} {'sg':>7s} "
              f"{'target (strips)':>15s}")
    for n in tokens:
        strip, sg = n * rows * 4, rows * hidden * 4
        for mode in ("weights", "activations", "auto"):
            for main_grad in (True, False):
                peak = backward_peak(group, mode, n, rows, hidden, main_grad)
                target = 3 * strip + (1 if main_grad else 2) * sg
                if dist.get_rank() == 0:
                    print(f"{n:6d} {mode:12s} {str(main_grad):>9s} {peak / strip:7.2f} "
                          f"{peak / sg:7.2f} {target / strip:15.2f}"
                          f"{'' if peak <= target else '  MISSED'}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
