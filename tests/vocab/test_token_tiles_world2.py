"""Ring-DTP's token tiles on a ring of 2: both schedules against dense fp64, the tile size
agreed by every rank before the first hop, and one rank's working set flat in N."""

import pytest
import torch
import torch.distributed as dist

from megatron_flat.runtime import MemoryMeter
from megatron_flat.vocab import ring_dtp_cross_entropy

pytestmark = pytest.mark.world(2)

TILE = 8 * 1024


@pytest.mark.parametrize("mode", ["weights", "activations"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ns", [(40, 40), (7, 90)])
def test_matches_dense(dist_world, ring_ref, mode, dtype, ns) -> None:
    p = ring_ref.make_problem(list(ns), vocab_size=500, rows=256, dtype=dtype, seed=sum(ns),
                              mask_every=6)
    ring_ref.check_rank(p, dist.get_rank(), dist.group.WORLD, mode=mode, tile_bytes=TILE)


def test_ranks_must_agree_on_the_tile(dist_world) -> None:
    rank = dist.get_rank()
    with pytest.raises(ValueError, match=r"disagree on tile_bytes \(per rank: \[4096, 8192\]\)"):
        ring_dtp_cross_entropy(torch.randn(4, 8), torch.randn(16, 8),
                               torch.zeros(4, dtype=torch.long), group=dist.group.WORLD,
                               tile_bytes=4096 * (rank + 1))


@pytest.mark.parametrize("mode", ["weights", "activations"])
def test_the_working_set_is_flat_in_n(dist_world, ring_ref, mode) -> None:
    """Peak minus the ring's N-sized and shard-sized buffers (ring_peak_bound without its
    strip) stays within one tile from N = 256 to 2,048; untiled it is the N x V/P strip."""
    rows, hidden = 256, 8
    rank = dist.get_rank()
    for n in (256, 2048):
        p = ring_ref.make_problem([n, n], vocab_size=2 * rows, hidden=hidden, rows=rows,
                                  seed=n)
        tok, row = p.token_slice(rank), p.row_slice(rank)
        x = p.x[tok].float().requires_grad_()
        w = p.w[row].float().requires_grad_()
        with MemoryMeter("cpu") as meter:
            loss = ring_dtp_cross_entropy(x, w, p.labels[tok], group=dist.group.WORLD,
                                          mode=mode, tile_bytes=TILE)
            loss.sum().backward()
        strip = n * rows * 4
        others = ring_ref.ring_peak_bound(mode, n, rows, hidden) - strip
        assert meter.peak_device_bytes - others <= TILE, (n, meter.peak_device_bytes, others)
